"""torch.distributed's rendezvous on one machine without a network listener.

SGLang 0.5.23 initialises torch.distributed with ``tcp://<--host>:<port>`` even for one process, and
torch's TCPStore server listens on every interface (``*:<port>``, IPv4 and IPv6) whatever host the
URL names: a server started on 127.0.0.1 still took connections from the network in its scheduler.
On one node the launcher sets SGLang's ``SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE`` to a FileStore in
a private (0700) directory instead: no socket at all, and no other local user can reach it.

Left alone: a user's own override, multi-node runs (``--nnodes``, ``--dist-init-addr``) and
``--dp-size`` > 1 (each data-parallel replica rendezvous on its own port; one file would mix them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV_VAR = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"


def wants_private_rendezvous(server_args) -> bool:
    return not (
        os.environ.get(ENV_VAR) or server_args.nnodes > 1 or server_args.dist_init_addr or server_args.dp_size > 1
    )


@contextmanager
def private_rendezvous(server_args) -> Iterator[Path | None]:
    """While open, SGLang's processes started from here rendezvous through a file in a fresh private
    directory (removed on exit); yields it, or None where :func:`wants_private_rendezvous` says no."""
    if not wants_private_rendezvous(server_args):
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="sgl-loopkv-rendezvous-"))  # mode 0700
    os.environ[ENV_VAR] = (root / "store").as_uri()  # inherited by the scheduler processes
    try:
        yield root
    finally:
        os.environ.pop(ENV_VAR, None)
        shutil.rmtree(root, ignore_errors=True)
