"""A script that holds a dist_gluon.elastic.State is never restarted from its start
without a word: in a job that is not elastic, the launcher says as the workers start
which flag recovers the State in memory."""
from conftest import launch

SCRIPT = """
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
net = gluon.nn.Dense(1, in_units=2)
net.initialize(mx.init.Zero())
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
state = dg.elastic.State(net=net, trainer=trainer, step=0)


@dg.elastic.run
def train(state):
    while state.step < 3:
        with autograd.record():
            loss = (net(mx.nd.ones((2, 2))) - 1).square().sum()
        loss.backward()
        trainer.step(2)
        state.step += 1
        state.commit()


train(state)
"""


def test_a_state_in_a_job_that_restarts_from_the_start_names_the_flag(tmp_path):
    """-n 2 --max-restarts 1 without --nnodes: the job runs (its workers would restart
    from the script's start), and the launcher says once that --nnodes 1:1 recovers the
    State in memory."""
    proc = launch(SCRIPT, tmp_path, launcher_args=["--max-restarts", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines()
            if "keeps a dist_gluon.elastic.State" in line]
    assert len(said) == 1, proc.stderr[-3000:]
    assert "--max-restarts 1 restarts every worker from the script's start" in said[0]
    assert "--nnodes 1:1" in said[0]
    # an elastic job recovers it in memory: nothing to say
    proc = launch(SCRIPT, tmp_path, launcher_args=["--nnodes", "1:1", "--max-restarts", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "keeps a dist_gluon.elastic.State" not in proc.stderr
