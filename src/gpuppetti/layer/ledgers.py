"""The daemon's ledgers, one per allocation, each served on a socket of its own (ledger.py says what one holds).

An allocation's directory holds its socket alone, and only the daemon writes there: containers mount it read-only,
which connect(2) works through, and a directory mount (not the socket's file) sees a socket a restarted daemon binds
anew. Where an allocation's socket path would pass the 107 bytes a socket's path may have, it is bound under a short
name in the layer directory and renamed into its allocation's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from gpuppetti.base.sockets import SOCKET_PATH_MAX, listening
from gpuppetti.layer.ledger import (
    FIGURE_LIMIT,
    MAX_CONNECTIONS,
    SOCKET_NAME,
    Connection,
    Ledger,
    SliceUse,
    Terms,
)

log = logging.getLogger(__name__)



class Ledgers:
    """The daemon's ledgers, one per allocation, each served on its socket in ``root``/<allocation>/."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: dict[str, tuple[Ledger, asyncio.Server]] = {}

    def directory(self, allocation: str) -> Path:
        return self.root / allocation

    def __contains__(self, allocation: str) -> bool:
        return allocation in self._open

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._open))

    def served_elsewhere(self, allocation: str) -> bool:
        """Whether another process (the other instance of a rolling update) serves the allocation's ledger now: its
        processes are connected there, and taking the socket over would split what they hold from what new ones
        reserve. One connect(2), which does not wait: call it in a thread all the same."""
        if allocation in self._open:
            return False
        target = self.directory(allocation) / SOCKET_NAME
        if len(os.fsencode(target)) <= SOCKET_PATH_MAX:
            return listening(target)
        # Too long to connect to: through a second name for the same socket, short, beside the layer directory's
        # own (connect(2) finds the listener by the file, whatever its name).
        alias = self.root.parent / f".c{secrets.token_hex(4)}"
        try:
            os.link(target, alias)
        except OSError:
            return False
        try:
            return listening(alias)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(alias)

    def bind(self, allocation: str) -> socket.socket:
        """The allocation's directory and its socket, bound and listening (an earlier socket there is replaced:
        a restarted daemon's). Blocks (a few system calls): call it in a thread, then ``serve`` it. Raises
        OSError."""
        make_private_directory(self.root)
        directory = self.directory(allocation)
        make_private_directory(directory)
        target = directory / SOCKET_NAME
        # A socket's path may not pass 107 bytes, and an allocation's under a long layer directory does (a DRA
        # request's name alone may take 63): there it is bound under a short name in the layer directory, on the
        # same filesystem, and renamed into place (which replaces an earlier socket at once).
        short = len(os.fsencode(target)) <= SOCKET_PATH_MAX
        bound = target if short else self.root.parent / f".b{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            if short:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target)
            listener.bind(str(bound))
            # Any user a container runs as connects (connect() needs write permission on the socket).
            os.chmod(bound, 0o666)
            if not short:
                os.rename(bound, target)
            listener.listen(MAX_CONNECTIONS)
            listener.setblocking(False)
        except OSError:
            listener.close()
            if not short:
                with contextlib.suppress(OSError):
                    os.unlink(bound)
            raise
        return listener

    async def serve(self, allocation: str, listener: socket.socket, terms: Sequence[Terms],
                    restored: bool = False) -> Ledger:
        """Serve an allocation's ledger on a socket ``bind`` made; an allocation served already keeps its ledger
        (what its processes hold) with these terms, and the new socket is closed. ``restored``: the allocation is
        an earlier run's, whose processes declare what they hold before any reservation is answered."""
        if (served := self._open.get(allocation)) is not None:
            listener.close()
            served[0].retune(terms)
            return served[0]
        ledger = Ledger(allocation, terms, restored)
        try:
            server = await asyncio.get_running_loop().create_unix_server(lambda: Connection(ledger), sock=listener)
        except BaseException:
            ledger.close()
            listener.close()
            raise
        self._open[allocation] = (ledger, server)
        return ledger

    async def open(self, allocation: str, terms: Sequence[Terms], restored: bool = False) -> Ledger:
        """``bind`` in a thread, then ``serve``. Raises OSError."""
        if (served := self._open.get(allocation)) is not None:
            served[0].retune(terms)
            return served[0]
        listener = await asyncio.to_thread(self.bind, allocation)
        return await self.serve(allocation, listener, terms, restored)

    def close(self, allocation: str) -> None:
        """Stop serving the allocation's ledger and disconnect its processes; ``remove`` takes its directory."""
        served = self._open.pop(allocation, None)
        if served is not None:
            ledger, server = served
            server.close()
            ledger.close()

    def remove(self, allocation: str) -> None:
        """The allocation's socket and directory, gone (only the daemon writes there). Blocks: call it in a thread.
        Never raises."""
        directory = self.directory(allocation)
        with contextlib.suppress(OSError):
            os.unlink(directory / SOCKET_NAME)
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the ledger directory %s: %s", directory, exc.strerror or exc)

    def on_disk(self) -> list[str]:
        """The allocations whose directories are there (an earlier run's too). Blocks: call it in a thread."""
        try:
            return [entry.name for entry in os.scandir(self.root) if entry.is_dir(follow_symlinks=False)]
        except OSError:
            return []

    def usage(self, allocation: str) -> list[SliceUse]:
        served = self._open.get(allocation)
        return served[0].usage() if served is not None else []

    def close_all(self) -> None:
        for allocation in list(self._open):
            self.close(allocation)

    async def keep(self) -> None:
        """Duty: the ledgers are served by the loop; at stop, each is closed (its processes wait for the next
        daemon, and declare what they hold to it)."""
        try:
            await asyncio.Event().wait()
        finally:
            self.close_all()


def make_private_directory(path: Path) -> None:
    """A directory only root writes (the containers read it), made without following a link that is there: an
    entry of another kind where it should be is replaced. Raises OSError."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(path)
            os.mkdir(path, 0o755)
    os.chmod(path, 0o755)


async def _serve_until_stopped(directory: Path, terms: list[Terms]) -> None:
    ledgers = Ledgers(directory.parent)
    await ledgers.open(directory.name, terms)
    print(f"serving {directory / SOCKET_NAME}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    try:
        await stop.wait()
    finally:
        ledgers.close_all()
        ledgers.remove(directory.name)


def main(argv: Sequence[str] | None = None) -> int:
    """One allocation's ledger, alone: what the layer's own tests (native/vulkan-layer) and the container tests run
    against, served as the daemons serve it."""
    parser = argparse.ArgumentParser(prog="python -m gpuppetti.layer.ledgers",
                                     description="serve one allocation's ledger at DIRECTORY/ledger.sock until "
                                                 "SIGTERM or SIGINT")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a ledger")
    serve.add_argument("directory", type=Path, help="the allocation's directory (made where missing)")
    serve.add_argument("--budgets", required=True, metavar="BYTES[,BYTES...]",
                       help="each slice's budget, in bytes (0: a whole GPU)")
    serve.add_argument("--compute", metavar="PERMILLE[,PERMILLE...]", help="each slice's share of its GPU's time")
    args = parser.parse_args(argv)
    try:
        budgets = [int(value) for value in args.budgets.split(",")]
        compute = [int(value) for value in args.compute.split(",")] if args.compute else [1000] * len(budgets)
    except ValueError:
        parser.error("--budgets and --compute take integers, comma-separated")
    if len(compute) != len(budgets) or any(not 0 <= b <= FIGURE_LIMIT for b in budgets):
        parser.error("--compute names one share per budget, and each budget is 0 to 2**63 - 1")
    args.directory.parent.mkdir(parents=True, exist_ok=True)
    asyncio.run(_serve_until_stopped(args.directory.absolute(),
                                     [Terms(b, c) for b, c in zip(budgets, compute, strict=True)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
