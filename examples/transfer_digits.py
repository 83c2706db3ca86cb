"""Fine-tune a pretrained TF1 network with restorekit, against a frozen probe and training from scratch.

This is ``restorekit demo``: the code lives in ``restorekit/demo/`` so an installed
package can run it; read ``training.py`` top to bottom. On scikit-learn's digits (no
download) it pretrains two convolutions and a head on digits 0-4 with Momentum and an
EMA, then learns digits 5-9, classes the pretraining never saw, from 5 images per
class with a new head and Adam, three ways on the same images: cold (from scratch),
probe (restored backbone frozen) and warm (restored backbone at 0.1x), over 10 seeds.
It prints the restore report (and how its counts add up), the group tables and the
accuracy table, and writes ``restorekit-demo/learning_curve.png``. 20-45 s on 2 CPU
cores::

    pip install 'restorekit[tf,demo]'
    python examples/transfer_digits.py                      # or: restorekit demo
    python examples/transfer_digits.py --seeds 3 --steps 60 --shots 1 --out /tmp/demo

The part to copy into your own training script (``restorekit.demo.finetune``), after
building the new graph, its loss and its variables::

    groups = group_variables({"backbone": 0.1, "head": 1.0})       # 0.0 freezes: the probe
    print(groups)                                                   # the group table
    optimizer = GroupedOptimizer(lambda m: tf1.train.AdamOptimizer(3e-3 * m), groups)
    train_op = optimizer.minimize(loss, global_step=tf1.train.get_or_create_global_step())
    scaffold = restorekit.easy_going_scaffold("pretrained/model.ckpt-1000", ema=True)
    print(scaffold.restore_report)                                  # what was restored, and why not
    with tf1.train.MonitoredTrainingSession(checkpoint_dir=run_dir, scaffold=scaffold) as session:
        for _ in range(100):
            session.run(train_op, feed_dict)

(``group_variables`` and ``GroupedOptimizer`` come from ``restorekit.finetune``.)
"""

import sys

from restorekit.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
