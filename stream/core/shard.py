"""Shards: several daemons (a StatefulSet's pods) share one config's streams, each taking its own part.

    shard = ""       every stream (the default)
    shard = "1/4"    this daemon is shard 1 of 4 (shards count from 0)
    shard = "auto"   I from the hostname's suffix (`stream-2` -> 2, a StatefulSet pod), N from $STREAM_SHARDS

Decision record:
- Rendezvous (highest-random-weight) hashing: each stream ranks the shards by blake2b(f"{shard}:{stream_id}"),
  a hash that is the same in every process and on every machine (Python's hash() is salted per process). A
  stream's place depends on its id and N only, so that going from N to N+1 shards moves about 1/(N+1) of the
  streams, and nothing needs to be told to the other shards: every pod reads the same config and computes the
  same split.
- Balanced, and only the new shard gains: plain rendezvous hashing leaves the busiest of 16 shards about 25% above
  the mean for 1,000 ids (balls into bins), and bounded-load variants, which spill a full shard's streams to
  the next in their ranking, move streams between old shards when N changes. The split is therefore built up
  one shard at a time: all streams start on shard 0; shard k joins by taking, always from the most loaded of
  shards 0..k-1, the stream that ranks shard k highest (its rendezvous weight for k), until it holds
  floor(m/(k+1)) of the m streams. So every shard holds floor(m/N) or ceil(m/N) streams; going from N to N+1
  moves exactly the new shard's streams (about 1/(N+1)), all of them to it; and going from N+1 back to N (a
  StatefulSet scales down from its highest ordinal, the only way it removes a pod) moves only the removed
  shard's streams. The cost: a stream's shard depends on the other ids of the config too, so every pod must
  read the same `sources` (one ConfigMap does that).
- Streams added at run time (`stream ctl add`) are not filtered: the operator sent them to this daemon.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stream.errors import ConfigError

SHARDS_ENV = "STREAM_SHARDS"  # `shard = "auto"`: the number of shards (a StatefulSet's replicas)
_HINT = 'write "I/N" (this daemon is shard I of N, I from 0 to N-1), "auto" (a StatefulSet pod) or "" (off)'


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class ShardView:
    """What a sharded daemon says about itself (`stream ctl list`, /status.json): its shard, what it skipped."""

    shard: Shard
    kept: tuple[str, ...]
    skipped: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        return {
            "shard": str(self.shard),
            "index": self.shard.index,
            "count": self.shard.count,
            "streams": len(self.kept),
            "skipped": list(self.skipped),
        }


def _parse(text: str, where: str) -> Shard:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None:
        raise ConfigError(f"{where}: {text!r} is not a shard; {_HINT}")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1:
        raise ConfigError(f"{where}: {text!r} has {count} shards; N must be at least 1; {_HINT}")
    if index >= count:
        raise ConfigError(f"{where}: {text!r}: shard {index} does not exist among {count} (0 to {count - 1}); {_HINT}")
    return Shard(index, count)


def check_shard(value: Any, origin: str) -> str:
    """The `shard` key: "", "auto" or "I/N" (its syntax; "auto" is looked up when the sources are resolved)."""
    where = f"'shard' in {origin}" if origin != "command line" else "--shard"
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string; {_HINT}; got {value!r}")
    text = value.strip()
    if text in ("", "auto"):
        return text
    _parse(text, where)
    return text


def auto_shard(hostname: str | None = None, environ: Mapping[str, str] | None = None) -> Shard:
    """`shard = "auto"`: I from the hostname's `-I` suffix (StatefulSet pods are NAME-0, NAME-1, ...), N from
    $STREAM_SHARDS (set it to the StatefulSet's replicas)."""
    env = os.environ if environ is None else environ
    host = socket.gethostname() if hostname is None else hostname
    raw = env.get(SHARDS_ENV)
    if raw is None or not raw.strip():
        raise ConfigError(
            f'shard = "auto" needs the number of shards in ${SHARDS_ENV} (a StatefulSet\'s replicas); '
            f"set it, or pass --shard I/N"
        )
    try:
        count = int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"${SHARDS_ENV} is {raw!r}, not a whole number; set it to the number of shards (the StatefulSet's replicas)"
        ) from None
    if count < 1:
        raise ConfigError(f"${SHARDS_ENV} is {count}; set it to the number of shards, at least 1")
    m = re.fullmatch(r".+-(\d+)", host.split(".", 1)[0])
    if m is None:
        raise ConfigError(
            f'shard = "auto" reads the shard from the hostname\'s "-I" suffix (StatefulSet pods: '
            f"NAME-0, NAME-1, ...); hostname {host!r} has none; pass --shard I/N"
        )
    index = int(m.group(1))
    if index >= count:
        raise ConfigError(
            f"hostname {host!r} is shard {index}, but ${SHARDS_ENV} is {count} (shards 0 to "
            f"{count - 1}); set ${SHARDS_ENV} to the StatefulSet's replicas"
        )
    return Shard(index, count)


def shard_of(value: str, hostname: str | None = None, environ: Mapping[str, str] | None = None) -> Shard | None:
    """The `shard` key's value as a Shard; None when off."""
    text = check_shard(value, "the config")
    if not text:
        return None
    if text == "auto":
        return auto_shard(hostname, environ)
    return _parse(text, "shard")


def _weight(shard: int | str, stream_id: str) -> int:
    digest = hashlib.blake2b(f"{shard}:{stream_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranking(stream_id: str, count: int) -> list[int]:
    """The shards in the stream's order of preference (plain rendezvous hashing, before balancing)."""
    return sorted(range(count), key=lambda s: (_weight(s, stream_id), -s), reverse=True)


def assign(stream_ids: Sequence[str], count: int) -> dict[str, int]:
    """Each stream id's shard among `count`: shards join one at a time, each taking the streams that rank it
    highest from the most loaded shards before it, until every shard holds floor(m/count) or ceil(m/count)."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    ids = list(dict.fromkeys(stream_ids))
    members: list[set[str]] = [set(ids)]
    for new in range(1, count):
        # each older shard's streams, best candidate for the new shard last (popped first)
        weight = {sid: (_weight(new, sid), sid) for sid in ids}
        queues = [sorted(m, key=weight.__getitem__) for m in members]
        heap = [(-len(m), k) for k, m in enumerate(members)]
        heapq.heapify(heap)
        taken: set[str] = set()
        for _ in range(len(ids) // (new + 1)):
            size, k = heapq.heappop(heap)
            sid = queues[k].pop()
            members[k].discard(sid)
            taken.add(sid)
            heapq.heappush(heap, (size + 1, k))
        members.append(taken)
    return {sid: k for k, m in enumerate(members) for sid in m}


def split(stream_ids: Sequence[str], shard: Shard) -> ShardView:
    """The ids this shard takes and those it leaves to the others, each in the given order."""
    owner = assign(stream_ids, shard.count)
    kept = tuple(sid for sid in stream_ids if owner[sid] == shard.index)
    skipped = tuple(sid for sid in stream_ids if owner[sid] != shard.index)
    return ShardView(shard, kept, skipped)
