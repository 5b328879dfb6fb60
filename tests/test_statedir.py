"""A node's /dev/shm directories: a launcher is proven alive by the lock it holds, not
by its pid (launchers in separate pid namespaces share /dev/shm); the node's copy
reserves its pages up front and says when /dev/shm is too small."""
import os
import subprocess
import sys
import textwrap

from conftest import process_env


def test_a_launcher_is_alive_while_it_holds_its_directorys_lock_whatever_its_pid(tmp_path):
    """A directory whose name carries a pid that means nothing here (a launcher of
    another pid namespace) is kept while a live process holds its lock; a directory
    whose lock nobody holds is removed even though the pid in its name is alive here
    (another namespace's launcher, killed, whose pid a live process of ours has); and
    the next launcher's own directories are made already locked."""
    from dist_gluon.launch import statedir
    holder_code = textwrap.dedent(f"""
        import sys
        from dist_gluon.launch import statedir
        print(statedir.make_control_dir({str(tmp_path)!r}), flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", holder_code], env=process_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = holder.stdout.readline().strip()
        assert os.path.basename(held).startswith(f"dg-control-{holder.pid}-")
        # the same lock under a name that says a dead process (another namespace's pid)
        dead = subprocess.Popen(["true"])
        dead.wait()
        foreign = tmp_path / f"dg-control-{dead.pid}-12345-f0f0"
        os.rename(held, foreign)
        # unlocked, named after a live process of this namespace (this test's)
        stale = tmp_path / (statedir.control_prefix() + "dead")
        stale.mkdir(mode=0o700)
        (stale / statedir.LOCK).touch()
        statedir.remove_orphan_controls(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == [foreign.name]
        mine = statedir.make_control_dir(str(tmp_path))
        statedir.remove_orphan_controls(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [foreign.name, os.path.basename(mine)])
        statedir.remove_dir(mine)
        assert not os.path.exists(mine)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # the holder has ended: its lock went with it, whatever its name says
    statedir.remove_orphan_controls(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
