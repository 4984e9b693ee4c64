"""Shards (stream/core/shard.py): every id on exactly one shard, balanced, moves only to an added shard and only
from a removed one;
`auto` from a StatefulSet pod's hostname and $STREAM_SHARDS; bad values are clear ConfigErrors."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream import config
from stream.core.shard import SHARDS_ENV, Shard, assign, auto_shard, shard_of, split
from stream.errors import ConfigError

IDS = [f"cam-{k:04d}" for k in range(1000)]
COUNTS = range(2, 17)


@pytest.mark.parametrize("count", COUNTS)
def test_every_id_on_exactly_one_shard(count: int) -> None:
    views = [split(IDS, Shard(i, count)) for i in range(count)]
    taken = [sid for v in views for sid in v.kept]
    assert sorted(taken) == sorted(IDS)  # each once: none lost, none twice
    for v in views:
        assert set(v.kept) | set(v.skipped) == set(IDS) and not set(v.kept) & set(v.skipped)


@pytest.mark.parametrize("count", COUNTS)
def test_no_shard_above_115_percent_of_the_mean(count: int) -> None:
    loads = [0] * count
    for shard in assign(IDS, count).values():
        loads[shard] += 1
    assert max(loads) <= 1.15 * len(IDS) / count, loads


@pytest.mark.parametrize("count", COUNTS)
def test_adding_a_shard_moves_few_ids(count: int) -> None:
    before, after = assign(IDS, count), assign(IDS, count + 1)
    moved = [sid for sid in IDS if before[sid] != after[sid]]
    assert len(moved) <= 1.3 / (count + 1) * len(IDS), f"{count} -> {count + 1}: {len(moved)} of {len(IDS)} moved"
    # every moved stream went to the new shard: none moved between the shards that were there
    assert {after[sid] for sid in moved} == {count}, f"{count} -> {count + 1}: streams moved between old shards"


@pytest.mark.parametrize("count", COUNTS)
def test_removing_a_replica_moves_only_its_own_streams(count: int) -> None:
    """A StatefulSet scales down from its highest ordinal: only that shard's streams move."""
    before, after = assign(IDS, count), assign(IDS, count - 1)
    moved = {sid for sid in IDS if before[sid] != after[sid]}
    assert moved == {sid for sid in IDS if before[sid] == count - 1}


@pytest.mark.parametrize("count", [1, 2, 3, 7, 16, 40])
@pytest.mark.parametrize("m", [0, 1, 5, 39, 1000])
def test_every_shard_holds_floor_or_ceil_of_the_mean(count: int, m: int) -> None:
    loads = [0] * count
    owners = assign(IDS[:m], count)
    assert sorted(owners) == sorted(IDS[:m])
    for shard in owners.values():
        loads[shard] += 1
    assert set(loads) <= {m // count, -(-m // count)}, loads


def test_the_split_is_stable_and_keeps_the_given_order() -> None:
    # the same on every machine and in every process (a fixed hash, not Python's salted hash())
    assert assign(["a", "b", "c", "d"], 2) == assign(["a", "b", "c", "d"], 2)
    view = split(IDS[:50], Shard(1, 3))
    assert list(view.kept) == [sid for sid in IDS[:50] if sid in view.kept]
    assert view.as_dict() == {
        "shard": "1/3",
        "index": 1,
        "count": 3,
        "streams": len(view.kept),
        "skipped": list(view.skipped),
    }


def test_one_shard_takes_everything_and_fewer_ids_than_shards_still_fit() -> None:
    assert set(assign(IDS[:10], 1).values()) == {0}
    owners = assign(["only"], 4)
    assert list(owners) == ["only"] and 0 <= owners["only"] < 4


@pytest.mark.parametrize(
    ("hostname", "env", "want"),
    [
        ("stream-0", "2", Shard(0, 2)),
        ("stream-1", "2", Shard(1, 2)),
        ("stream-gpu-11", "12", Shard(11, 12)),
        ("stream-3.stream.default.svc.cluster.local", "4", Shard(3, 4)),
        ("stream-0", " 1 ", Shard(0, 1)),
    ],
)
def test_auto_from_hostname_and_env(hostname: str, env: str, want: Shard) -> None:
    assert auto_shard(hostname, {SHARDS_ENV: env}) == want
    assert shard_of("auto", hostname, {SHARDS_ENV: env}) == want


@pytest.mark.parametrize(
    ("hostname", "env", "words"),
    [
        ("stream-0", None, [SHARDS_ENV, "replicas", "--shard I/N"]),
        ("stream-0", "", [SHARDS_ENV, "--shard I/N"]),
        ("stream-0", "two", [SHARDS_ENV, "'two'", "whole number"]),
        ("stream-0", "0", [SHARDS_ENV, "at least 1"]),
        ("laptop", "2", ["'laptop'", "hostname", "-I", "--shard I/N"]),
        ("stream-2", "2", ["'stream-2'", "shard 2", SHARDS_ENV, "0 to 1"]),
    ],
)
def test_auto_errors_say_what_is_missing(hostname: str, env: str | None, words: list[str]) -> None:
    environ = {} if env is None else {SHARDS_ENV: env}
    with pytest.raises(ConfigError) as err:
        auto_shard(hostname, environ)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("2/2", ["'2/2'", "0 to 1"]),
        ("1/0", ["'1/0'", "at least 1"]),
        ("1", ["'1'", "not a shard", "I/N"]),
        ("a/b", ["'a/b'", "I/N"]),
        ("-1/2", ["'-1/2'", "I/N"]),
        ("yes", ["'yes'", "auto"]),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(tmp_path: Path, value: str, words: list[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(f'shard = "{value}"\n')
    with pytest.raises(ConfigError) as err:
        config.load(p)
    assert "'shard'" in str(err.value) and str(p) in str(err.value)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    with pytest.raises(ConfigError) as err:
        config.load(None, {"shard": value})
    assert "--shard" in str(err.value)


def test_shard_is_a_string_and_defaults_off(tmp_path: Path) -> None:
    assert config.Config().shard == "" and shard_of("") is None
    p = tmp_path / "c.toml"
    p.write_text("shard = 1\n")
    with pytest.raises(ConfigError, match="must be a string"):
        config.load(p)
    assert config.load(None, {"shard": " 1/4 "}).shard == "1/4"
    assert config.load(None, {"shard": "auto"}).shard == "auto"
