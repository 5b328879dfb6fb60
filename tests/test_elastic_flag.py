"""A script that holds a dist_gluon.elastic.State is never restarted from its start
without a word: a job on one machine with --max-restarts recovers it in memory (as
--nnodes 1:1), and a job that cannot says, as its workers start, what would."""
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


def test_a_state_in_a_job_that_cannot_recover_it_in_memory_names_what_would(tmp_path):
    """Without --max-restarts, or over MPI, a failure would end the job or restart it
    from the script's start: the launcher says once which flag recovers the State."""
    proc = launch(SCRIPT, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines()
            if "keeps a dist_gluon.elastic.State" in line]
    assert len(said) == 1, proc.stderr[-3000:]
    assert "without --max-restarts a failure ends the job" in said[0]
    assert "--max-restarts R" in said[0]
    # one machine with --max-restarts is elastic (as --nnodes 1:1): nothing to say
    for flags in (["--max-restarts", "1"], ["--nnodes", "1:1", "--max-restarts", "1"]):
        proc = launch(SCRIPT, tmp_path, launcher_args=flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "keeps a dist_gluon.elastic.State" not in proc.stderr, flags


def test_what_the_launcher_says_of_a_state_it_cannot_recover_in_memory(monkeypatch):
    from dist_gluon.launch.cli import parse
    from dist_gluon.launch.rounds import state_not_recovered

    mpi = parse(["-n", "2", "--max-restarts", "2", "--transport", "mpi", "--", "python",
                 "t.py"]) if _mpirun() else None
    if mpi is not None:
        assert not mpi.elastic
        text = state_not_recovered(mpi)
        assert "--max-restarts 2 restarts every worker from the script's start" in text
        assert "--transport gloo" in text
    monkeypatch.setenv("DG_JOB_SECRET", "0" * 64)
    static = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                    "-n", "2", "--max-restarts", "1", "--", "python", "t.py"])
    assert not static.elastic
    assert "--nnodes MIN:MAX" in state_not_recovered(static)
    one = parse(["-n", "2", "--max-restarts", "1", "--", "python", "t.py"])
    assert one.elastic and one.one_machine and (one.min_nodes, one.max_nodes) == (1, 1)


def _mpirun() -> bool:
    from dist_gluon.launch import mpi
    return bool(mpi.mpirun_path())
