"""The job secret: what tells the launchers (and the Gloo workers) of one job apart from
anything else that reaches node 0's ports.

Every message between launchers carries an HMAC made with it (channel.py), and the Gloo
rendezvous serves only requests whose path holds a token derived from it
(rendezvous.py). Where it comes from:

- ``-H``/``--hostfile``: node 0's side makes a fresh one (``secrets.token_hex(32)``) and
  writes it as the first line of each ssh session's stdin, so it appears on no command
  line (``ps``) and in no environment the remote shell logs.
- one launcher per node (``--nnodes M --node-rank I``, also under SLURM): the file named
  by ``--job-secret-file`` or else ``DG_JOB_SECRET``, the same on every node; without
  either a job of several nodes is a usage error, so that no stranger can ever join one.
- a job of one node: a fresh one, used only by its rendezvous.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

ENV = "DG_JOB_SECRET"
FILE_FLAG = "--job-secret-file"
HOW_TO_MAKE_ONE = (
    "create one and give the same one to every node, e.g. `export DG_JOB_SECRET=$(python "
    "-c 'import secrets; print(secrets.token_hex(32))')` before starting the launchers "
    "(srun passes it on), or write it to a file only you can read, on every node, and "
    f"add {FILE_FLAG} PATH")
_MAX_SECRET = 4096


def generate() -> str:
    return secrets.token_hex(32)


def for_node(secret_file: str | None, environ, nnodes: int) -> str:
    """This launcher's job secret for a per-node launch; raises ValueError saying what
    to do when a job of several nodes has none (or it cannot be read)."""
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                text = f.read(_MAX_SECRET + 1)
        except OSError as err:
            raise ValueError(f"cannot read {FILE_FLAG} {secret_file!r}: {err}") from err
        return _checked(text.decode("utf-8", "replace"), f"{FILE_FLAG} {secret_file}")
    if environ.get(ENV) is not None:
        return _checked(environ[ENV], ENV)
    if nnodes > 1:
        raise ValueError(
            f"a job of {nnodes} nodes needs a job secret, so that only its own launchers "
            f"can join it (anything that reaches node 0's port could otherwise take a "
            f"node's place): {HOW_TO_MAKE_ONE}")
    return generate()


def read_from_stdin(fd: int = 0) -> str:
    """The secret that the -H launcher wrote as the first line of this ssh session's
    stdin (byte by byte: the rest of stdin is watched for the session's end)."""
    data = b""
    while not data.endswith(b"\n") and len(data) <= _MAX_SECRET:
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return _checked(data.decode("utf-8", "replace"), "the first line of stdin (from -H)")


def _checked(text: str, where: str) -> str:
    secret = text.strip()
    if not secret:
        raise ValueError(f"the job secret in {where} is empty: {HOW_TO_MAKE_ONE}")
    if len(secret) > _MAX_SECRET or "\n" in secret:
        raise ValueError(f"the job secret in {where} must be one line of at most "
                         f"{_MAX_SECRET} characters")
    return secret


def derive(secret: str, purpose: str) -> str:
    """A token for ``purpose`` that every node computes alike and nobody can compute
    without the secret; it never reveals the secret itself."""
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).hexdigest()[:32]


def rendezvous_token(secret: str, spec: dict) -> str:
    """The Gloo rendezvous token of one run of the job (node 0's server and every
    node's workers compute it alike)."""
    return derive(secret, f"gloo rendezvous {spec['restart']} {spec['rendezvous_port']}")
