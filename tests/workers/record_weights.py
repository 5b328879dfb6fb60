"""Run a training script unchanged (as ``__main__``), then save this rank's trained weights.

    python record_weights.py OUT_DIR SCRIPT [ARGS...]

The peers' examples set no seed. Each rank seeds MXNet and NumPy with its own rank
first, so the ranks start from different weights and shuffle differently: only the
script's own broadcast and gradient averaging can make them agree. The parameters of
every gluon.Trainer the script creates (``<trainer>.<position>``), and the arg_params of
every mx.mod.Module it trains (``module<m>.<name>``), are written to
``OUT_DIR/rank<R>.npz`` (R from DG_RANK) once the script has finished.
"""
import os
import runpy
import sys

import mxnet as mx
import numpy as np

out_dir, script = sys.argv[1], os.path.abspath(sys.argv[2])
sys.argv = sys.argv[2:]
rank = int(os.environ.get("DG_RANK", "0"))
mx.random.seed(rank)
np.random.seed(rank)

trainers = []
trainer_init = mx.gluon.Trainer.__init__


def remembering_init(self, *args, **kwargs):
    trainer_init(self, *args, **kwargs)
    trainers.append(self)


mx.gluon.Trainer.__init__ = remembering_init

modules = []
module_init = mx.mod.Module.__init__


def remembering_module_init(self, *args, **kwargs):
    module_init(self, *args, **kwargs)
    modules.append(self)


mx.mod.Module.__init__ = remembering_module_init
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")

arrays = {f"{t}.{i}": param.data().asnumpy()
          for t, trainer in enumerate(trainers) for i, param in enumerate(trainer._params)}
for m, module in enumerate(mod for mod in modules if mod.optimizer_initialized):
    arrays.update({f"module{m}.{name}": value.asnumpy()
                   for name, value in sorted(module.get_params()[0].items())})
assert arrays, f"{script} created no gluon.Trainer and trained no mx.mod.Module"
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
