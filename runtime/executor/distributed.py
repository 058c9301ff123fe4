"""Tensor parallelism on torch.distributed: the process group, the collectives the model
needs, and the step message rank 0 sends the other ranks.

Rank 0 runs the scheduler (EngineCore); every rank holds a slice of each layer and its own
KV pool (its KV heads only). Before each forward pass rank 0 broadcasts what fully
determines it: the `ForwardItem`s (row, prefix length, new ids, new slots, all_logits) and
the request-to-token table writes the scheduler made since the last step (rows that took a
cached prefix). The message is a small int64 tensor, sent as two broadcasts (a fixed
header, then the body); no pickle. Followers run the same forward and never sample: the
sampled tokens reach them as the next step's new ids, so every rank agrees.

Every collective has a deadline (--dist-timeout-s, minutes): a rank that dies or hangs
fails the others' next collective instead of hanging them. While the server idles, rank 0
sends a keepalive header every quarter of it (`start_keepalive`), so followers waiting for
the next step do not time out; `TPGroup.lock` keeps it out of a step's collectives. With
an address given, rank 0's rendezvous store listens on that address only.

Nothing here runs at tp 1: the model uses plain modules and the runner sends nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from spruce.runtime.errors import SpruceError

logger = logging.getLogger("spruce")

STOP, STEP, KEEPALIVE = 0, 1, 2
HEADER = 4  # kind, items, table writes, body length
ITEM = 4  # row, prefix_len, new tokens, all_logits
WRITE = 3  # row, start, slots
KEEPALIVE_MAX_S = 30.0  # rank 0's keepalive period: a quarter of the timeout, at most this


class DistributedError(SpruceError):
    """A tensor-parallel rank could not join the others (address, timeout, sizes)."""


class RankLost(SpruceError):
    """A tensor-parallel rank died or stopped answering: the group cannot compute any more.
    The message names no file or address (it reaches clients)."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the tensor-parallel ranks."""

    rank: int
    world: int
    group: object  # the torch.distributed process group of the step traffic
    device: torch.device  # where the collectives' tensors live (cpu for gloo)
    timeout_s: float = 300.0  # every collective's deadline
    lock: threading.Lock = field(
        default_factory=threading.Lock, compare=False
    )  # rank 0: one sender at a time

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Placement:
    """Where this process stands: its rank, the world size, the rendezvous address (None
    under torchrun: env://) and the ranks it must start on this machine."""

    rank: int
    world: int
    init_addr: str | None
    local_followers: tuple[int, ...]


def placement(
    tp_size: int, nnodes: int = 1, node_rank: int = 0, init_addr: str | None = None
) -> Placement:
    """This process's rank: from torchrun's RANK / WORLD_SIZE when set (it started every
    rank), else the first rank of this node, which starts the node's other ranks."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        if world != tp_size:
            raise DistributedError(f"WORLD_SIZE {world} (torchrun) differs from --tp {tp_size}")
        return Placement(int(env["RANK"]), world, None, ())
    if tp_size % nnodes:
        raise DistributedError(f"--tp {tp_size} does not divide over --nnodes {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise DistributedError(f"--node-rank {node_rank} is not in 0..{nnodes - 1}")
    if nnodes > 1 and not init_addr:
        raise DistributedError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
    per_node = tp_size // nnodes
    first = node_rank * per_node
    addr = init_addr or f"127.0.0.1:{free_port()}"
    return Placement(first, tp_size, addr, tuple(range(first + 1, first + per_node)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(name: str, device: str) -> str:
    if name != "auto":
        return name
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(
    rank: int, world: int, init_addr: str | None, backend: str, timeout_s: float
) -> TPGroup:
    """Joins the ranks; a rank that cannot reach the others within `timeout_s` gets a
    DistributedError naming the address, never a hang. The step traffic then runs on a
    group with the same deadline (rank 0's keepalives cover idle time)."""
    env = os.environ
    where = init_addr or f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if init_addr is None:  # torchrun: env://
            dist.init_process_group(
                backend, init_method="env://", rank=rank, world_size=world, timeout=timeout
            )
        else:
            store = rendezvous_store(init_addr, rank, world, timeout)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
        dist.barrier()
        group = dist.new_group(list(range(world)), timeout=timeout, backend=backend)
    except (RuntimeError, ValueError, OSError) as e:
        close_group()
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"tensor-parallel rank {rank} of {world} could not join the others at {where} "
            f"({backend}) within {timeout_s:g} s: {first}"
        ) from None
    cuda = backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    logger.info("tensor parallel: rank %d of %d joined at %s (%s)", rank, world, where, backend)
    return TPGroup(rank, world, group, device, timeout_s)


def rendezvous_store(
    init_addr: str, rank: int, world: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The ranks' key-value store at HOST:PORT. Rank 0 serves it on a socket bound to that
    address only (torch's own listens on every interface); the others connect."""
    host, _, port = init_addr.rpartition(":")
    host = host.strip("[]")
    if rank != 0:
        return dist.TCPStore(host, int(port), world, False, timeout)
    family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[
        0
    ]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(max(world, 128))
    except OSError:
        listener.close()
        raise
    fd = listener.detach()  # the store owns it now
    return dist.TCPStore(host, int(port), world, True, timeout, master_listen_fd=fd)


def close_group() -> None:
    """Leaves the group; after a join that failed, also resets torch's group counter (a
    failed init_process_group has counted its group, so a later join in this process would
    name its store keys differently from fresh ranks and wait for them forever)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        c10d._world.group_count = 0


# -- collectives the model uses (tp > 1 only) -------------------------------------------------


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum of x over the ranks, in place (x is this rank's partial result)."""
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The ranks' x concatenated along the last dimension (rank order)."""
    parts = [torch.empty_like(x) for _ in range(tp.world)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


# -- the step message ------------------------------------------------------------------------


@dataclass(slots=True)
class StepMessage:
    """A forward pass as plain numbers: items (row, prefix_len, new ids, new slots,
    all_logits) and table writes (row, start, slots) to apply first."""

    items: list[tuple[int, int, list[int], torch.Tensor, bool]]
    writes: list[tuple[int, int, torch.Tensor]]


def encode_step(msg: StepMessage) -> torch.Tensor:
    """The message body as one int64 tensor: the item and write tables, then the new ids,
    the new slots and the written slots, each concatenated."""
    items = [[row, prefix, len(ids), int(flag)] for row, prefix, ids, _, flag in msg.items]
    writes = [[row, start, slots.numel()] for row, start, slots in msg.writes]
    parts = [
        torch.tensor(items, dtype=torch.int64).reshape(-1),
        torch.tensor(writes, dtype=torch.int64).reshape(-1),
        torch.tensor([t for _, _, ids, _, _ in msg.items for t in ids], dtype=torch.int64),
        *[slots.to("cpu", torch.int64).reshape(-1) for _, _, _, slots, _ in msg.items],
        *[slots.to("cpu", torch.int64).reshape(-1) for _, _, slots in msg.writes],
    ]
    return torch.cat(parts)


def decode_step(body: torch.Tensor, n_items: int, n_writes: int) -> StepMessage:
    body = body.to("cpu")
    items = body[: n_items * ITEM].view(n_items, ITEM).tolist()
    at = n_items * ITEM
    writes = body[at : at + n_writes * WRITE].view(n_writes, WRITE).tolist()
    at += n_writes * WRITE
    n_tokens = sum(n for _, _, n, _ in items)
    ids = body[at : at + n_tokens].tolist()
    slots = body[at + n_tokens : at + 2 * n_tokens]
    at += 2 * n_tokens
    out_items, start = [], 0
    for row, prefix, n, flag in items:
        end = start + n
        out_items.append((row, prefix, ids[start:end], slots[start:end], bool(flag)))
        start = end
    out_writes = []
    for row, first, n in writes:
        out_writes.append((row, first, body[at : at + n]))
        at += n
    return StepMessage(out_items, out_writes)


def send_step(tp: TPGroup, msg: StepMessage) -> None:
    body = encode_step(msg)
    header = torch.tensor([STEP, len(msg.items), len(msg.writes), body.numel()], dtype=torch.int64)
    dist.broadcast(header.to(tp.device), src=0, group=tp.group)
    dist.broadcast(body.to(tp.device), src=0, group=tp.group)


def send_stop(tp: TPGroup) -> None:
    header = torch.tensor([STOP, 0, 0, 0], dtype=torch.int64)
    dist.broadcast(header.to(tp.device), src=0, group=tp.group)


def send_keepalive(tp: TPGroup) -> None:
    header = torch.tensor([KEEPALIVE, 0, 0, 0], dtype=torch.int64)
    dist.broadcast(header.to(tp.device), src=0, group=tp.group)


def start_keepalive(
    tp: TPGroup, stopped: Callable[[], bool], on_error: Callable[[str], None]
) -> threading.Thread:
    """Rank 0: a keepalive header every quarter of the timeout (at most KEEPALIVE_MAX_S)
    until `stopped()`; a failing one calls `on_error` with a message naming no address."""
    period = min(tp.timeout_s / 4, KEEPALIVE_MAX_S)

    def run() -> None:
        while True:
            time.sleep(period)
            with tp.lock:
                if stopped():
                    return
                try:
                    send_keepalive(tp)
                except Exception:
                    logger.exception("tensor parallel: a keepalive failed")
                    on_error("a tensor-parallel rank stopped answering")
                    return

    thread = threading.Thread(target=run, name="spruce-tp-keepalive", daemon=True)
    thread.start()
    return thread


def receive_step(tp: TPGroup) -> StepMessage | None:
    """The next step from rank 0 (keepalives skipped); None when it says stop."""
    header = torch.empty(HEADER, dtype=torch.int64, device=tp.device)
    kind = KEEPALIVE
    while kind == KEEPALIVE:
        dist.broadcast(header, src=0, group=tp.group)
        kind, n_items, n_writes, length = header.tolist()
    if kind == STOP:
        return None
    body = torch.empty(length, dtype=torch.int64, device=tp.device)
    dist.broadcast(body, src=0, group=tp.group)
    return decode_step(body, n_items, n_writes)


def broadcast_ints(values: list[int] | None, count: int, tp: TPGroup) -> list[int]:
    """Rank 0's `count` ints on every rank (the followers pass None): the pool sizes. On
    the joining group, whose timeout stands: a rank that died loading fails the others."""
    t = torch.tensor(values if tp.is_leader else [0] * count, dtype=torch.int64, device=tp.device)
    dist.broadcast(t, src=0)
    return t.tolist()
