"""The bubblewrap (``bwrap``) command line that isolates one tool call.

    sandbox = Sandbox(bwrap="/usr/bin/bwrap", read_only=read_only_paths(), as_root=True)
    command = [*sandbox.command(workdir), sys.executable, "-I", ...]

What the call gets: a root filesystem of its own (a tmpfs, read-only once built) holding
only read-only views of what Python needs (``/usr``, the ``/bin``/``/lib`` links and the
interpreter's prefixes with their site-packages), ``/dev``'s null/zero/random devices, a
``/proc`` of its own PID namespace and ``workdir``, writable, as its working directory.
No ``/etc``, no home directories, no other ``/tmp`` entry, no host ``/proc``. New PID, network,
IPC, UTS and cgroup namespaces: it sees and signals only its own processes, has no network
(no interface is up, not even loopback), and when its first process exits bwrap's init
exits too, so the kernel kills every process left in the namespace. ``--die-with-parent``
does the same when arbor kills bwrap on a timeout.

Its user: where arbor runs as root, bwrap runs as root without a user namespace (a user
namespace would map the sandbox's user back to root outside, and the kernel does not
enforce RLIMIT_NPROC for root), keeps only CAP_SETUID and CAP_SETGID, and the bootstrap
drops to ``uid`` (a fresh one per call, see :func:`call_uid`) before running any of the
tool's code: all capabilities go with that switch, and no-new-privs (bwrap sets it) stops
any from coming back. Where arbor is not root, bwrap makes a user namespace mapping uid/gid
65534 inside to arbor's user outside (no capabilities), and the process limit counts that
namespace's processes only.
"""

from __future__ import annotations

import os
import secrets
import site
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath

NOBODY = 65534
# Fresh per-call users (root only) come from this range: far above any /etc/passwd user and
# below the 32-bit "no user" value. Two concurrent calls drawing the same uid (one in a
# billion) would only share their process-count limit: their files and processes are
# still in separate namespaces.
CALL_UID_RANGE = (1_000_000_000, 2_000_000_000)


def call_uid() -> int | None:
    """A fresh uid for one call where arbor is root (the bootstrap switches to it), else
    None: an unprivileged arbor gets uid 65534 from bwrap's user namespace instead."""
    if os.geteuid() != 0:
        return None
    low, high = CALL_UID_RANGE
    return low + secrets.randbelow(high - low)


def read_only_paths() -> tuple[str, ...]:
    """What the interpreter needs, outermost paths only: ``/usr`` and the prefixes and
    site-packages of this Python (a pyenv, conda or virtualenv install lives outside
    ``/usr``). ``/bin``, ``/lib``... are handled by :meth:`Sandbox.command`."""
    candidates = {"/usr", sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  str(PurePosixPath(os.path.realpath(sys.executable)).parent.parent), *site.getsitepackages()}
    paths = sorted(os.path.realpath(p) for p in candidates if p and os.path.isdir(p))
    outermost: list[str] = []
    for path in paths:  # sorted: a path's ancestors come before it
        if not any(path == kept or path.startswith(kept.rstrip("/") + "/") for kept in outermost):
            outermost.append(path)
    return tuple(p for p in outermost if p != "/")


@dataclass(frozen=True)
class Sandbox:
    bwrap: str  # path of the bwrap program
    read_only: tuple[str, ...]  # host directories bound read-only at the same path
    as_root: bool  # arbor is root: no user namespace, the bootstrap drops to a fresh uid

    def command(self, workdir: str) -> list[str]:
        """bwrap and its options, up to (not including) the program to run. The program enters
        ``workdir`` itself: it may belong to the call's own user, whom bwrap is not yet."""
        command = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                   "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        if self.as_root:  # kept only for the bootstrap's switch to the call's own uid
            command += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            command += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        made: set[str] = set()
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # merged /usr: links into it
            if os.path.islink(top):
                command += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                command += ["--ro-bind", top, top]
                made.add(top)
        for path in self.read_only:
            command += _parents(path, made) + ["--ro-bind", path, path]
            made.add(path)
        command += _parents(workdir, made) + ["--bind", workdir, workdir]
        return command + ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/"]


def _parents(path: str, made: set[str]) -> list[str]:
    """``--dir`` options making ``path``'s missing parents traversable (bwrap would make
    them mode 0700, which the call's own user could not enter)."""
    options = []
    for parent in reversed(PurePosixPath(path).parents):
        name = str(parent)
        if name == "/" or name in made:
            continue
        options += ["--perms", "0755", "--dir", name]
        made.add(name)
    return options
