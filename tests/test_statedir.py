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


def test_a_node_copy_that_does_not_fit_in_dev_shm_fails_at_its_first_commit_saying_sizes(
        tmp_path):
    """On a 1 MiB tmpfs (a container's small /dev/shm), the node's copy of a 0.8 MiB
    state needs two slots: the first commit's allocation fails with the sizes needed and
    free (not a SIGBUS in an engine thread later); a state that fits gets its pages
    reserved at once (the file's blocks are allocated, not a hole)."""
    import pytest
    mount = tmp_path / "shm"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs",
                           str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        code = textwrap.dedent(f"""
            import os
            import mxnet as mx
            from dist_gluon.elastic import nodecopy
            copy = nodecopy.NodeCopy({str(mount)!r}, "00ff", writer=True)
            small = [mx.nd.ones((1000,))]
            slot, copies = copy.allocate([("w",)], small)
            path = os.path.join({str(mount)!r}, copy._files[slot][0])
            print("reserved", os.stat(path).st_blocks * 512 >= 4000)
            try:
                copy.allocate([("w",)], [mx.nd.ones((200000,))])
            except nodecopy.NodeCopyError as err:
                print("refused", err)
        """)
        proc = subprocess.run([sys.executable, "-c", code], env=process_env(),
                              capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert proc.returncode == 0, proc.stderr
    reserved, refused = proc.stdout.splitlines()
    assert reserved == "reserved True"
    assert refused.startswith("refused the node's copy of the elastic State needs 1.5 MiB")
    assert "two copies of 0.8 MiB" in refused and "MiB are free there" in refused
    assert "--shm-size" in refused
