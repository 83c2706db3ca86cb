"""Fine-tune a pretrained TF1 network with restorekit and compare it with training from scratch.

This is ``restorekit demo``: the code lives in ``restorekit/demo.py`` so an installed
package can run it; read it top to bottom. On scikit-learn's digits (no download) it
pretrains a backbone on "which digit" with Momentum and an EMA, then learns "odd or
even" from 20 images with a new head, an extra layer and Adam, warm and cold, over
several seeds; it prints the restore report, the group table and the accuracy table
and writes ``restorekit-demo/learning_curve.png``. About a minute on 2 CPU cores::

    pip install 'restorekit[tf,demo]'
    python examples/transfer_digits.py                      # or: restorekit demo
    python examples/transfer_digits.py --seeds 3 --steps 60 --out /tmp/demo

The part to copy into your own training script (``restorekit.demo.finetune``), after
building the new graph, its loss and its variables::

    groups = group_variables({"backbone": 0.1, "head": 1.0})       # print(groups): the table
    optimizer = GroupedOptimizer(lambda m: tf1.train.AdamOptimizer(3e-3 * m), groups)
    train_op = optimizer.minimize(loss, global_step=tf1.train.get_or_create_global_step())
    scaffold = restorekit.easy_going_scaffold("pretrained/model.ckpt-400", ema=True)
    print(scaffold.restore_report)                                  # what was restored, and why not
    with tf1.train.MonitoredTrainingSession(checkpoint_dir=run_dir, scaffold=scaffold) as session:
        for _ in range(150):
            session.run(train_op, feed_dict)

(``group_variables`` and ``GroupedOptimizer`` come from ``restorekit.finetune``.)
"""

import sys

from restorekit.demo import main

if __name__ == "__main__":
    sys.exit(main())
