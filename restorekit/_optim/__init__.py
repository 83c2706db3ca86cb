"""Optimizer state as part of a restore (issue 36): ``scan(source, module, optimizer=opt)``, then ``restore``.

``_tf1`` groups a TF1 checkpoint's slots by weight, ``_keras2_state`` a Keras 2 (tf-keras)
optimizer's slots in a TF2 checkpoint, ``_keras_state`` a Keras 3 optimizer's saved
variables and ``_torch_state`` a torch training checkpoint's ``optimizer.state_dict()``,
in TF1's terms; ``_common`` answers what every target asks (each weight's
status, the step count, a weight's slots through its record's view); ``_convert`` turns them
into ``torch.optim`` state (pure numpy; the table of semantics is its docstring); ``_plan``
builds the report's optimizer section for ``torch.optim`` (``_torch`` writes it at restore)
hands a Keras 3 optimizer to ``_keras``, which plans and assigns on any backend, and an ``nnx.Optimizer``
to ``_optax``, which reads its optax chain by name and sets its state after the weights.
``_tf1_target`` goes back: a torch training checkpoint's state, in the same TF1 terms, written as TF1 slots
beside the weights (``tf1_training``).
"""
