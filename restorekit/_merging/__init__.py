"""Model merging (``restorekit.merge``): mergekit's recipes and methods, streamed over any mix of sources.

``_recipe`` is the recipe as a checked, frozen value; ``_methods`` one small class per method
with one per-tensor function; ``_pipeline`` what every merge shares with ``restorekit.average``
(open, plan, stream, commit once); ``_merge`` the public function.
"""

from restorekit._merging._merge import MergeResult, merge
from restorekit._merging._methods import METHODS
from restorekit._merging._recipe import MergeRecipe, ModelSpec, load_recipe

__all__ = ["METHODS", "MergeRecipe", "MergeResult", "ModelSpec", "load_recipe", "merge"]
