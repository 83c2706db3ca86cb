"""Optimizer state as part of a restore (issue 36): ``scan(source, module, optimizer=opt)``, then ``restore``.

``_tf1`` groups a TF1 checkpoint's slots by weight, ``_convert`` turns them into the
target optimizer's state (pure numpy; the table of semantics is its docstring), ``_plan``
pairs them through the weights' records and builds the report's optimizer section, and
``_torch`` writes them into ``torch.optim`` at restore.
"""
