"""The Redis store, against a real ``redis-server`` (Debian's package, which
``make test`` installs) started here on a free port with a small ``maxmemory``
and ``allkeys-lru``, and stopped here. No mock stands in for Redis.

Every reply is compared with plain ``model.generate`` on the whole
conversation (float64 tiny models); every fault must give that reply and a
logged, counted miss, never an exception or a wrong answer."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import redis
import torch
from helpers import (
    LONG_SYSTEM,
    LONGER_SYSTEM,
    MAX_NEW,
    exact_turns,
    model_for,
    reference_turn,
    user_message,
)
from kvchat import _C, RedisTier, SessionManager, StoreUnavailable
from kvchat.prompting import render_prompt
from kvchat.serve.process import redis_server
from kvchat.serve.sessions import conversation_digests
from kvchat.tiny import tiny_tokenizer

pytestmark = pytest.mark.store

HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _needs_redis_server():
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: `make test` installs it (apt redis-server)")


@pytest.fixture
def server():
    with redis_server(maxmemory="256mb") as server:
        yield server


@contextlib.contextmanager
def _hung(server):
    """Redis hung (SIGSTOP: it accepts connections and never answers), then back."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def _turns(manager, session, messages, model, tokenizer, turns, start=0):
    """``exact_turns``, then the manager's writes to the store are flushed."""
    result = exact_turns(manager, session, messages, model, tokenizer, turns, start)
    manager.flush()
    return result


def _manifest(server, manager, session):
    client = redis.Redis.from_url(server.redis_url)
    key = manager._tier.keys.manifest(session)
    return client, key, json.loads(client.get(key))


# --------------------------------------------------------- two processes
class Worker:
    """A SessionManager in its own process (store_worker.py)."""

    def __init__(self, family: str, url: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "store_worker.py"), family, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert json.loads(self.process.stdout.readline()) == {"ready": True}

    def chat(self, session: str, messages: list[dict]) -> dict:
        request = {"session": session, "messages": messages, "max_new_tokens": MAX_NEW}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the worker process died"
        return json.loads(line)

    def close(self) -> dict:
        self.process.stdin.write(json.dumps({"quit": True}) + "\n")
        self.process.stdin.flush()
        stats = json.loads(self.process.stdout.readline())["stats"]
        self.process.wait(timeout=60)
        return stats

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.mark.parametrize("family", ["llama", "falcon_h1"])
def test_two_processes_alternate_the_turns_of_eight_conversations(family, tokenizer, server):
    """Processes A and B share one Redis: turn 1 of each conversation on A (or
    B), turn 2 on the other, and so on. Every reply is plain generate's; from
    turn 2 on, every turn starts from the other process's snapshot and reuses
    at least 90% of its prompt."""
    model = model_for(family)
    workers = [Worker(family, server.redis_url), Worker(family, server.redis_url)]
    try:
        # LONGER_SYSTEM: with 200 tokens, even one process reuses only 88%.
        conversations = {f"conv-{c}": [LONGER_SYSTEM] for c in range(8)}
        for turn in range(6):
            for c, session in enumerate(conversations):
                messages = [*conversations[session], user_message(turn + c)]
                answer = workers[(turn + c) % 2].chat(session, messages)
                expected = reference_turn(model, tokenizer, messages)[0]
                assert answer["reply"] == expected, (session, turn)
                assert answer["stored"], "the snapshot write did not finish"
                report = answer["report"]
                if turn > 0:
                    assert report["reason"] == "store_reload", (session, turn, report)
                    assert report["reused_tokens"] >= 0.9 * report["prompt_tokens"], report
                conversations[session] = [*messages, {"role": "assistant", "content": expected}]
        stats = [w.close() for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert sum(s["store_loads"] for s in stats) == 8 * 5
    assert sum(s["store_writes"] for s in stats) == 8 * 6
    assert all(s["store_write_errors"] == 0 for s in stats)


# --------------------------------------------------------------- faults
def _two_managers(url, model, tokenizer, **tier_args):
    return (
        SessionManager(model, tokenizer, tier=RedisTier(url, **tier_args)),
        SessionManager(model, tokenizer, tier=RedisTier(url, **tier_args)),
    )


def _miss_on_b(a, b, model, tokenizer, caplog, reason, fault, session="s"):
    """Turn 1 on A (stored), ``fault()``, then turn 2 on B: plain generate's
    reply, no reuse from the store, and a logged miss with ``reason``."""
    messages, _ = _turns(a, session, [LONG_SYSTEM], model, tokenizer, 1)
    fault()
    with caplog.at_level(logging.INFO, logger="kvchat"):
        _, reports = _turns(b, session, messages, model, tokenizer, 1, start=1)
    assert reports[0].reason != "store_reload"
    assert b.stats().store_miss_reasons.get(reason) == 1, b.stats().store_miss_reasons
    assert any(f"({reason})" in r.getMessage() for r in caplog.records), caplog.text


def test_a_flipped_byte_in_a_chunk_is_a_miss(llama, tokenizer, server, caplog):
    a, b = _two_managers(server.redis_url, llama, tokenizer)

    def flip():
        client, _, manifest = _manifest(server, a, "s")
        digest = next(iter(manifest["tensors"].values()))["chunks"][0]
        key = a._tier.keys.chunk(digest, "s")
        byte = client.getrange(key, 100, 100)
        client.setrange(key, 100, bytes([byte[0] ^ 0x01]))

    _miss_on_b(a, b, llama, tokenizer, caplog, "checksum", flip)


def test_a_deleted_chunk_is_a_miss(llama, tokenizer, server, caplog):
    a, b = _two_managers(server.redis_url, llama, tokenizer)

    def delete():
        client, _, manifest = _manifest(server, a, "s")
        entries = list(manifest["tensors"].values())
        assert client.delete(a._tier.keys.chunk(entries[-1]["chunks"][-1], "s")) == 1

    _miss_on_b(a, b, llama, tokenizer, caplog, "chunk_missing", delete)


def test_an_unknown_format_is_a_miss(llama, tokenizer, server, caplog):
    a, b = _two_managers(server.redis_url, llama, tokenizer)

    def reformat():
        client, key, manifest = _manifest(server, a, "s")
        client.set(key, json.dumps(dict(manifest, format="kvchat-store-99")))

    _miss_on_b(a, b, llama, tokenizer, caplog, "format", reformat)


def test_another_models_snapshot_is_never_used(llama, tokenizer, server, caplog):
    """Another model's snapshot of the same session id lives under its own key
    (the key holds the fingerprint); copied over this model's key, the
    fingerprint in the manifest refuses it."""
    other = SessionManager(model_for("llama", seed=1), tokenizer, store=server.redis_url)
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    _turns(other, "s", [LONG_SYSTEM], model_for("llama", seed=1), tokenizer, 1)
    assert other._tier.keys.manifest("s") != a._tier.keys.manifest("s")

    def copy_over():
        client, _, manifest = _manifest(server, other, "s")
        client.set(a._tier.keys.manifest("s"), json.dumps(manifest))

    # No turn on A first: B's first turn finds only the other model's snapshot.
    with caplog.at_level(logging.INFO, logger="kvchat"):
        copy_over()
        _, reports = _turns(b, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    assert reports[0].reason == "no_cache"
    assert b.stats().store_miss_reasons == {"fingerprint": 1}
    assert "(fingerprint)" in caplog.text


def test_an_expired_snapshot_is_a_miss(llama, tokenizer, server, caplog):
    a, b = _two_managers(server.redis_url, llama, tokenizer, ttl=1)
    client = redis.Redis.from_url(server.redis_url)

    def expire():
        key = a._tier.keys.manifest("s")
        assert 0 < client.ttl(key) <= 1
        deadline = time.monotonic() + 10
        while client.exists(key) and time.monotonic() < deadline:
            time.sleep(0.1)

    _miss_on_b(a, b, llama, tokenizer, caplog, "absent", expire)


def test_a_diverged_history_reuses_only_the_true_prefix(llama, tokenizer, server):
    """A snapshot of another conversation under the same id: the turn is exact
    and reuses no more than the two share."""
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 2)
    _, _, manifest = _manifest(server, a, "s")
    stored = torch.frombuffer(bytearray(base64.b64decode(manifest["ids"])), dtype=torch.int64)
    other = [{"role": "system", "content": "Something else entirely, said differently."}]
    prompt = render_prompt(tokenizer, [*other, user_message(5)])
    common = _C.common_prefix_length(stored, prompt)
    assert 0 < common < 10
    _, reports = _turns(b, "s", other, llama, tokenizer, 1, start=5)
    assert reports[0].reused_tokens <= common


def test_maxmemory_eviction_under_load_gives_misses_not_wrong_answers(llama, tokenizer, caplog):
    """A 2 MiB Redis holds a few snapshots: writing 8 sessions evicts the
    older ones' manifests or chunks. Every turn stays exact; the evicted
    sessions' next turns are counted misses."""
    with redis_server(maxmemory="2mb") as small:
        a, b = _two_managers(small.redis_url, llama, tokenizer)
        conversations = {}
        for c in range(8):
            conversations[c], _ = _turns(a, f"s{c}", [LONG_SYSTEM], llama, tokenizer, 1, start=c)
        info = redis.Redis.from_url(small.redis_url).info("stats")
        assert info["evicted_keys"] > 0
        with caplog.at_level(logging.INFO, logger="kvchat"):
            for c in range(8):
                _turns(b, f"s{c}", conversations[c], llama, tokenizer, 1, start=c + 1)
        stats = b.stats()
        reasons = stats.store_miss_reasons
        assert reasons.get("absent", 0) + reasons.get("chunk_missing", 0) > 0, reasons
        assert stats.store_loads + stats.store_misses == 8


def test_redis_down_or_hung_then_back(llama, tokenizer, caplog):
    """Killed mid-run: turns go on, exact, with a logged miss; hung (SIGSTOP),
    a call times out after ``timeout`` instead of blocking the turn; restarted
    on the same port, the store is used again."""
    with redis_server() as first:
        a, b = _two_managers(first.redis_url, llama, tokenizer, timeout=0.3, retry_after=0.5)
        messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
        first.kill()
        with caplog.at_level(logging.WARNING, logger="kvchat"):
            messages, _ = _turns(b, "s", messages, llama, tokenizer, 1, start=1)
            messages, _ = _turns(a, "s", messages, llama, tokenizer, 1, start=2)
        assert b.stats().store_miss_reasons == {"unavailable": 1}
        assert a.stats().store_write_errors >= 1
        assert "Redis store" in caplog.text

        # Back on the same port, empty (nothing was saved).
        with redis_server(port=first.port) as server:
            time.sleep(0.6)  # past retry_after
            messages, _ = _turns(b, "s", messages, llama, tokenizer, 1, start=3)
            _, reports = _turns(a, "s", messages, llama, tokenizer, 1, start=4)
            assert reports[0].reason == "store_reload"

            os.kill(server.process.pid, signal.SIGSTOP)  # accepts, never answers
            try:
                c = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url, timeout=0.3))
                _turns(c, "s", messages, llama, tokenizer, 1, start=5)
                assert c.stats().store_miss_reasons == {"unavailable": 1}
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            assert c._tier.flush(timeout=30)


def test_two_writers_of_one_session_leave_one_whole_snapshot(llama, tokenizer, server):
    """A and B finish turns of the same session id at once, on two different
    conversations: the stored snapshot is one of the two, whole, and a third
    manager continues it exactly from the store."""
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    firsts = [[LONG_SYSTEM, user_message(0)], [LONG_SYSTEM, user_message(1)]]
    replies = [None, None]

    def run(i, manager):
        replies[i] = manager.chat("s", firsts[i], max_new_tokens=MAX_NEW)
        manager.flush()

    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, _, manifest = _manifest(server, a, "s")
    winner = [i for i in (0, 1) if manifest["messages"][1] == firsts[i][1]]
    assert len(winner) == 1
    messages = [*firsts[winner[0]], {"role": "assistant", "content": replies[winner[0]]}]
    c = SessionManager(llama, tokenizer, store=server.redis_url)
    _, reports = _turns(c, "s", messages, llama, tokenizer, 1, start=2)
    assert reports[0].reason == "store_reload" and c.stats().store_misses == 0


def test_hybrid_snapshots_restore_recurrent_state(tokenizer, server):
    """FalconH1 (Mamba2 beside attention): the checkpoints travel, so the other
    manager restores the recurrent state at the last message boundary."""
    model = model_for("falcon_h1")
    a, b = _two_managers(server.redis_url, model, tokenizer)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], model, tokenizer, 2)
    _, reports = _turns(b, "s", messages, model, tokenizer, 1, start=2)
    assert reports[0].reason == "store_reload" and reports[0].checkpoint_restored is not None


def test_eviction_policy_writes_only_when_evicted(llama, tokenizer, server):
    tier = RedisTier(server.redis_url, write="evict")
    a = SessionManager(llama, tokenizer, max_sessions=1, tier=tier)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    assert a.stats().store_writes == 0
    _turns(a, "other", [LONG_SYSTEM], llama, tokenizer, 1)  # evicts "s"
    assert a.stats().store_writes == 1
    b = SessionManager(llama, tokenizer, store=server.redis_url)
    _, reports = _turns(b, "s", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reason == "store_reload"


def test_remove_deletes_the_snapshot_and_local_only_keeps_it(llama, tokenizer, server):
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    client = redis.Redis.from_url(server.redis_url)
    _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    a.remove("s", local_only=True)
    a.flush()
    assert client.exists(a._tier.keys.manifest("s"))
    _turns(b, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    b.remove("s")
    b.flush()
    assert not client.exists(a._tier.keys.manifest("s"))


def test_store_argument_errors(llama, tokenizer, tmp_path):
    with pytest.raises(TypeError, match="store must be a redis:// URL"):
        SessionManager(llama, tokenizer, store=123)
    with pytest.raises(ValueError, match="store must be a redis:// URL, as .*, got 'localhost'"):
        SessionManager(llama, tokenizer, store="localhost")
    with pytest.raises(ValueError, match="one of store, spill_dir or tier"):
        SessionManager(llama, tokenizer, store="redis://127.0.0.1:1/0", spill_dir=tmp_path)
    with pytest.raises(ValueError, match="write must be one of"):
        RedisTier("redis://127.0.0.1:1/0", write="sometimes")
    with pytest.raises(ValueError, match="ttl must be a positive number of seconds, got 0"):
        RedisTier("redis://127.0.0.1:1/0", ttl=0)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        RedisTier("redis://127.0.0.1:1/0", timeout=-1)
    with pytest.raises(ValueError, match="retry_after must be a positive number of seconds"):
        RedisTier("redis://127.0.0.1:1/0", retry_after="5")


def test_chunks_are_shared_across_turns(llama, tokenizer, server):
    """A turn uploads only the token blocks that are new: the blocks of the
    prefix are the same bytes, under the same names, as the last turn's."""
    a = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url, block_tokens=64))
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    first = a._tier.writer.chunks_written
    _turns(a, "s", messages, llama, tokenizer, 1, start=1)
    second = a._tier.writer.chunks_written - first
    assert 0 < second < first / 2, (first, second)


# ------------------------------------------------------------ two servers
@pytest.mark.parametrize("family", ["llama", "falcon_h1"])
def test_two_server_replicas_continue_each_others_turns(family, tokenizer, server):
    """Two `kvchat serve --store` replicas behind a round-robin client: every
    reply is plain generate's, every turn from the second on starts from the
    snapshot the other replica stored before its reply ended, and /metrics
    counts the loads."""
    from serving import MAX_NEW as SERVE_MAX_NEW
    from serving import Server, ask, client_for, reference_model

    flags = ("--store", server.redis_url, "--api-key", "k")
    replicas = [Server(f"tiny:{family}", *flags), Server(f"tiny:{family}", *flags)]
    try:
        model = reference_model(family)
        messages = [LONG_SYSTEM]
        for turn in range(6):
            replica = replicas[turn % 2]
            messages.append(user_message(turn))
            reply, usage = ask(client_for(replica, "k"), messages, "conv", stream=turn % 3 != 0)
            assert reply == reference_turn(model, tokenizer, messages, SERVE_MAX_NEW)[0], turn
            last = replica.session("conv", "k")["last_turn"]
            if turn > 0:
                assert last["reason"] == "store_reload", (turn, last)
                assert usage.prompt_tokens_details.cached_tokens == last["reused_tokens"] > 0
            messages.append({"role": "assistant", "content": reply})
        for replica in replicas:
            text = replica.get("/metrics", "k").text
            loads = re.search(r"^kvchat_store_loads_total (\S+)$", text, re.M)
            assert loads and float(loads.group(1)) >= 2, text[-2000:]
            assert re.search(r"^kvchat_store_writes_total 3\.0$", text, re.M), text[-2000:]
    finally:
        for replica in replicas:
            replica.stop()


def test_keyless_clients_continue_across_replicas(tokenizer, server):
    """A client that names no session (the plain OpenAI SDK, an agent loop):
    the conversation-to-session map lives in the store too, so the other
    replica continues the same session from its snapshot."""
    from serving import MAX_NEW as SERVE_MAX_NEW
    from serving import Server, ask, client_for, reference_model

    flags = ("--store", server.redis_url, "--api-key", "k")
    replicas = [Server("tiny:llama", *flags), Server("tiny:llama", *flags)]
    try:
        model, messages, seen = reference_model("llama"), [LONG_SYSTEM], set()
        for turn in range(4):
            replica = replicas[turn % 2]
            messages.append(user_message(turn))
            reply, usage = ask(client_for(replica, "k"), messages, None, stream=True)
            assert reply == reference_turn(model, tokenizer, messages, SERVE_MAX_NEW)[0], turn
            sessions = replica.get("/v1/sessions", "k").json()["data"]
            assert len(sessions) == 1, sessions
            seen.add(sessions[0]["id"])
            last = replica.session(sessions[0]["id"], "k")["last_turn"]
            if turn > 0:
                assert last["reason"] == "store_reload", (turn, last)
                assert usage.prompt_tokens_details.cached_tokens > 0.8 * usage.prompt_tokens
            messages.append({"role": "assistant", "content": reply})
        assert len(seen) == 1, f"one conversation became sessions {seen}"
    finally:
        for replica in replicas:
            replica.stop()


def test_a_response_made_on_one_replica_is_continued_on_the_other(server):
    """`/v1/responses` on two `kvchat serve --store` replicas: the response is
    stored in Redis, so the other replica continues it by previous_response_id
    (no key), from the session's snapshot; another key still cannot."""
    from serving import Server

    flags = ("--store", server.redis_url, "--api-key", "k", "--api-key", "k2")
    replicas = [Server("tiny:llama", *flags), Server("tiny:llama", *flags)]
    try:
        common = dict(model="tiny:llama", instructions=LONG_SYSTEM["content"], temperature=0)
        first = (
            replicas[0]
            .client("k")
            .responses.create(**common, input="Hello there.", max_output_tokens=6)
        )
        previous = first.id
        for turn in range(2):
            replica = replicas[(turn + 1) % 2]
            response = replica.client("k").responses.create(
                **common, input=f"And {turn}?", previous_response_id=previous, max_output_tokens=6
            )
            details = response.usage.input_tokens_details
            assert details.cached_tokens > 0.8 * response.usage.input_tokens, turn
            assert replica.client("k").responses.retrieve(response.id).id == response.id
            previous = response.id
        sessions = [r.get("/v1/sessions", "k").json()["data"] for r in replicas]
        assert {s["id"] for data in sessions for s in data} == {sessions[1][0]["id"]}
        with pytest.raises(openai.NotFoundError):
            replicas[1].client("k2").responses.retrieve(previous)
    finally:
        for replica in replicas:
            replica.stop()


def _stored_responses(manager, per_key: int, bytes_per_key: int, ttl: float):
    """What `kvchat serve` stores its responses in over ``manager``'s tier."""
    from kvchat.serve.store import ResponseLimits, server_store

    limits = ResponseLimits(per_key=per_key, bytes_per_key=bytes_per_key, ttl=ttl)
    return server_store(manager.tier, limits).responses


def _record_bytes(response: dict, conversation: list) -> int:
    """A stored response's size: its record, as JSON."""
    record = {"response": response, "conversation": conversation, "session_key": None}
    return len(json.dumps(record).encode())


def _response_keys(client) -> list[bytes]:
    """Every key in Redis that stored responses use."""
    kinds = (b":response:", b":responses-of:", b":response-sizes:", b":responses:")
    return [k for k in client.scan_iter(count=1000) if any(kind in k for kind in kinds)]


def test_stored_responses_are_bounded_per_key_in_redis(llama, tokenizer, server):
    """Two replicas' response stores on one Redis (kvchat serve --store): a
    key past its bound in count, or in bytes, loses its own oldest records,
    whichever replica stored them, never another key's; a record larger than
    the byte bound alone is not stored and evicts nothing; both replicas count
    the same totals, and a delete gives back its bytes; every key the records
    use expires with the TTL."""
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    one, two = (_stored_responses(m, 3, 2000, ttl=60) for m in (a, b))
    assert one.put("key-a", "a1", {"n": "a"}, [])
    for i in range(5):  # key B fills its 3, alternately on each replica
        (one, two)[i % 2].put("key-b", f"b{i}", {"n": i}, [{"role": "user", "content": "hi"}])
    assert two.get("key-a", "a1")["response"] == {"n": "a"}
    kept = [one.get("key-b", f"b{i}") is not None for i in range(5)]
    assert kept == [False, False, True, True, True]
    assert two.get("key-b", "b4")["response"] == {"n": 4}

    pad = {"pad": "x" * 760}  # about 800 bytes: 3 of them are over 2000
    assert _record_bytes(pad, []) * 2 < 2000 < _record_bytes(pad, []) * 3
    for i in range(3):
        (one, two)[i % 2].put("key-c", f"c{i}", pad, [])
    assert [two.get("key-c", f"c{i}") is not None for i in range(3)] == [False, True, True]
    assert not one.put("key-c", "huge", {"pad": "x" * 2000}, [])
    assert two.get("key-c", "huge") is None and two.get("key-c", "c1") is not None
    assert one.evicted + two.evicted == 3

    sizes = [
        _record_bytes({"n": "a"}, []),
        *(_record_bytes({"n": i}, [{"role": "user", "content": "hi"}]) for i in (2, 3, 4)),
        _record_bytes(pad, []) * 2,
    ]
    assert one.totals() == two.totals() == (6, sum(sizes))
    assert two.delete("key-c", "c2") and not one.delete("key-c", "c2")
    assert one.totals() == (5, sum(sizes) - _record_bytes(pad, []))
    client = redis.Redis.from_url(server.redis_url)
    keys = _response_keys(client)
    assert len(keys) == 5 + 3 * 2 + 1, keys  # records; index and sizes per key; the list of keys
    assert all(0 < client.pttl(k) <= 60_000 for k in keys), [(k, client.pttl(k)) for k in keys]


def test_stored_responses_in_redis_expire_with_the_ttl(llama, tokenizer, server):
    """Past the TTL a stored response is gone and leaves its key's bounds and
    the totals (an older one expired beside a newer one still kept), and at
    last nothing of them is left in Redis."""
    (manager,) = _two_managers(server.redis_url, llama, tokenizer)[:1]
    responses = _stored_responses(manager, 3, 2000, ttl=2)
    client = redis.Redis.from_url(server.redis_url)

    def wait(done, what):
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    responses.put("key-a", "older", {"n": 1}, [])
    time.sleep(1)
    responses.put("key-a", "newer", {"n": 22}, [])
    wait(lambda: responses.get("key-a", "older") is None, "the older one expired")
    if responses.get("key-a", "newer") is not None:  # (not yet expired itself)
        assert responses.totals() == (1, _record_bytes({"n": 22}, []))
    # The list of every key's index lives as long as the longest-lived index
    # (another test's, on this Redis), so it is left out here.
    ours = lambda: [k for k in _response_keys(client) if b":responses:" not in k]  # noqa: E731
    wait(lambda: not ours(), "every key of them expired")
    assert responses.totals() == (0, 0)


def test_a_missing_redis_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'kvchat\[redis\]'"):
        RedisTier("redis://127.0.0.1:1/0")


def _mutations(manifest: dict):
    """Ways a manifest can be wrong, each still valid JSON."""
    name = next(iter(manifest["tensors"]))
    entry = manifest["tensors"][name]
    yield "ids not base64", dict(manifest, ids="%%%")
    yield "ids of another length", dict(manifest, ids=manifest["ids"][:8])
    yield "tensors not a dict", dict(manifest, tensors=[1, 2])
    yield (
        "a tensor missing",
        dict(manifest, tensors={k: v for k, v in manifest["tensors"].items() if k != name}),
    )
    for field, value in (
        ("dtype", "float128"),
        ("dtype", "int8"),
        ("shape", [1, 1, 1, 1]),
        ("shape", "wide"),
        ("split", "rows"),
        ("chunks", entry["chunks"][:-1]),
        ("chunks", None),
        ("bytes", []),
    ):
        yield (
            f"{field}={value!r}",
            dict(manifest, tensors={**manifest["tensors"], name: dict(entry, **{field: value})}),
        )
    layout = manifest["layout"]
    yield "layers missing", dict(manifest, layout=dict(layout, layers=layout["layers"][:-1]))
    yield (
        "a layer's kind",
        dict(manifest, layout=dict(layout, layers=[{"kind": "conv"}, *layout["layers"][1:]])),
    )
    yield "trusted tokens a string", dict(manifest, layout=dict(layout, trusted_tokens="all"))
    yield "text not a string", dict(manifest, layout=dict(layout, text=7))
    yield "layout null", dict(manifest, layout=None)


def test_a_malformed_manifest_is_a_miss_never_an_exception(llama, tokenizer, server, caplog):
    """Manifests edited in each of many ways (valid JSON, correct fingerprint and
    session): every turn on them is plain generate's reply, never an error."""
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    client, key, manifest = _manifest(server, a, "s")
    messages.append(user_message(1))
    expected = reference_turn(llama, tokenizer, messages)[0]
    cases = list(_mutations(manifest))
    for what, bad in cases:
        client.set(key, json.dumps(bad))
        assert b.chat("s", messages, max_new_tokens=MAX_NEW) == expected, what
        assert b.last_turn("s").reason != "store_reload", what
        b.remove("s", local_only=True)  # nothing held here next time: the store is asked
        b.flush()  # its own snapshot of this turn is written before the next edit
    assert sum(b.stats().store_miss_reasons.values()) == len(cases)


def test_a_closed_store_is_not_used(llama, tokenizer, server):
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    b.close()
    _, reports = _turns(b, "s", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reason == "no_cache"
    assert b.stats().store_miss_reasons == {"unavailable": 1}


# ------------------------------------------------- tenants, deletion, secrets
def _upload(manager, session, system, model, tokenizer):
    """(chunks, bytes) the tier uploads for one turn of ``session``."""
    tier = manager.tier
    chunks, nbytes = tier.writer.chunks_written, tier.writer.bytes_written
    _turns(manager, session, [system], model, tokenizer, 1)
    return tier.writer.chunks_written - chunks, tier.writer.bytes_written - nbytes


def test_chunks_are_not_shared_across_namespaces(llama, tokenizer, server):
    """Content addressing stops at a namespace (an API key in kvchat serve):
    what tenant B's turn uploads is the same whether or not tenant A stored
    the same document first, so B cannot tell (by the upload's time) what A
    sent. Within one namespace the chunks are still shared."""
    client = redis.Redis.from_url(server.redis_url)

    def manager():
        return SessionManager(llama, tokenizer, store=server.redis_url, isolate_namespaces=True)

    alone = _upload(manager(), "tenant-b/doc", LONG_SYSTEM, llama, tokenizer)
    assert alone[0] > 0
    client.flushdb()
    _upload(manager(), "tenant-a/doc", LONG_SYSTEM, llama, tokenizer)
    after_a = _upload(manager(), "tenant-b/doc", LONG_SYSTEM, llama, tokenizer)
    assert after_a == alone, "tenant B's upload depends on what tenant A stored"
    # The same document in tenant A's namespace again: only the new blocks go up.
    again = _upload(manager(), "tenant-a/other", LONG_SYSTEM, llama, tokenizer)
    assert again[0] < alone[0] / 2, (again, alone)


def _keyspace(client) -> tuple[dict, set, list]:
    """(session id -> manifest, chunk digests, every other key) in Redis."""
    manifests, chunks, others = {}, set(), []
    for key in client.scan_iter(count=1000):
        name = key.decode()
        if ":session:" in name:
            manifest = json.loads(client.get(key))
            manifests[manifest["session_id"]] = manifest
        elif ":chunk:" in name:
            chunks.add(name.rsplit(":", 1)[1])
        else:
            others.append(name)
    return manifests, chunks, others


def _referenced(manifests: dict) -> set:
    return {d for m in manifests.values() for e in m["tensors"].values() for d in e["chunks"]}


def test_a_delete_on_either_replica_deletes_everywhere(tokenizer, server):
    """Two `kvchat serve` replicas on one Redis. DELETE on one replica removes
    the session there, on the other replica (which held it too, or alone) and
    in Redis (manifest, and every chunk no live session uses): GET says 404 on
    both, the next turn on either reuses nothing, and nothing of it is left in
    the keyspace but its tombstone. A conversation started again under the id
    then works as any other, reuse across replicas included."""
    import httpx
    from serving import Server, ask, client_for

    flags = ("--store", server.redis_url, "--api-key", "k")
    replicas = [Server("tiny:llama", *flags), Server("tiny:llama", *flags)]
    client = redis.Redis.from_url(server.redis_url)
    auth = {"Authorization": "Bearer k"}

    def system(name):  # its own system prompt: nothing shared with another session
        return dict(LONG_SYSTEM, content=f"Session {name}. {LONG_SYSTEM['content']}")

    def turn(replica, name, messages, t):
        messages = [*messages, user_message(t)]
        reply, usage = ask(client_for(replicas[replica], "k"), messages, name, stream=t % 2 == 0)
        return [*messages, {"role": "assistant", "content": reply}], usage

    try:
        conversations = {}
        for deleter in (0, 1):
            other = 1 - deleter
            # "both-": held by both replicas; "remote-": only by the other one.
            both, _ = turn(deleter, f"both-{deleter}", [system(f"both-{deleter}")], 0)
            conversations[f"both-{deleter}"], _ = turn(other, f"both-{deleter}", both, 1)
            conversations[f"remote-{deleter}"], _ = turn(
                other, f"remote-{deleter}", [system(f"remote-{deleter}")], 0
            )
        for deleter in (0, 1):
            names = (f"both-{deleter}", f"remote-{deleter}")
            manifests, _, _ = _keyspace(client)
            theirs = _referenced({s: m for s, m in manifests.items() if s.endswith(names)})
            for name in names:
                url = f"{replicas[deleter].url}/v1/sessions/{name}"
                response = httpx.delete(url, headers=auth, timeout=60)
                assert response.status_code == 200, (name, response.text)
                for replica in replicas:  # not listed, even where a copy was held
                    listed = [s["id"] for s in replica.get("/v1/sessions", "k").json()["data"]]
                    assert name not in listed, (name, replica.url, listed)
                for replica in replicas:
                    got = replica.get(f"/v1/sessions/{name}", "k")
                    assert got.status_code == 404, (name, replica.url, got.text)
            manifests, chunks, others = _keyspace(client)
            assert not [s for s in manifests if s.rsplit("/", 1)[1] in names], manifests.keys()
            assert not (theirs - _referenced(manifests)) & chunks, "their chunks are left"
        manifests, chunks, others = _keyspace(client)
        assert not manifests and not chunks, (manifests.keys(), len(chunks))
        assert all(":deleted:" in key for key in others), others
        for key in others:  # a tombstone holds a random token, nothing of the session
            assert len(client.get(key)) <= 64

        for deleter in (0, 1):
            for name, replica in ((f"both-{deleter}", 1 - deleter), (f"remote-{deleter}", deleter)):
                messages, usage = turn(replica, name, conversations[name], 2)
                assert usage.prompt_tokens_details.cached_tokens == 0, (name, usage)
                history = replicas[replica].session(name, "k")["history"]
                assert history == messages, name
                # Started again: the old tombstone deletes nothing, the other replica reloads.
                _, usage = turn(1 - replica, name, messages, 3)
                last = replicas[1 - replica].session(name, "k")["last_turn"]
                assert last["reason"] == "store_reload", (name, last)
                assert usage.prompt_tokens_details.cached_tokens > 0
    finally:
        for replica in replicas:
            replica.stop()


def test_a_write_queued_before_a_delete_does_not_bring_it_back(llama, tokenizer, server):
    """B's snapshot of a turn is still being written when A deletes the
    session: it is not published (nor are its chunks left), and B's next turn
    starts from nothing, as does any other manager's."""
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    client = redis.Redis.from_url(server.redis_url)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    go, writing = threading.Event(), threading.Event()
    original = b.tier.writer.write

    def held_write(*args):
        writing.set()
        assert go.wait(60)
        return original(*args)

    b.tier.writer.write = held_write
    messages.append(user_message(1))
    messages.append({"role": "assistant", "content": b.chat("s", messages, max_new_tokens=MAX_NEW)})
    assert b.last_turn("s").reason == "store_reload"
    assert writing.wait(60)
    a.remove("s")
    go.set()
    assert b.flush(timeout=60)
    manifests, chunks, others = _keyspace(client)
    assert not manifests and not chunks, (manifests.keys(), len(chunks))
    assert all(":deleted:" in key for key in others), others
    # A manager that does not write its turns (so B then finds nothing either), then B.
    reader = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url, write="evict"))
    for manager in (reader, b):
        _, reports = _turns(manager, "s", messages, llama, tokenizer, 1, start=2)
        assert reports[0].reused_tokens == 0 and reports[0].reason != "store_reload", reports


def test_a_delete_keeps_the_chunks_another_session_uses(llama, tokenizer, server):
    """Two sessions of one conversation share their chunks; deleting one
    leaves the other whole in the store."""
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    messages, _ = _turns(a, "one", [LONG_SYSTEM], llama, tokenizer, 1)
    _turns(a, "two", [LONG_SYSTEM], llama, tokenizer, 1)
    a.remove("one")
    _, reports = _turns(b, "two", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reason == "store_reload" and b.stats().store_misses == 0


SECRET, SECOND = "s3cr3t", "Pa55w0rd"  # a password's two halves: neither may show


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}-{SECOND}@127.0.0.1:notaport/0",
        f"redis://admin{SECRET}:{SECRET}-{SECOND}@127.0.0.1:notaport/0",
        f"rediss://u:{SECRET}-{SECOND}@[::1:notaport/0",
        f"redis://127.0.0.1:notaport/0?password={SECRET}-{SECOND}",
        f"admin:{SECRET}-{SECOND}@127.0.0.1:6379",
        # A password with a character that ends the host part, not percent-encoded:
        f"redis://:{SECRET}/{SECOND}@127.0.0.1:6379/0",
        f"redis://:{SECRET}#{SECOND}@127.0.0.1:6379/0",
        f"redis://:{SECRET}?{SECOND}@127.0.0.1:6379/0",
        f"redis://u:{SECRET}/{SECOND}@127.0.0.1/0",
        f"redis://u:123/{SECRET}{SECOND}@127.0.0.1/0",
        # A ':' typed for the '@'.
        f"redis://user:{SECRET}{SECOND}:127.0.0.1:6379/0",
        f"redis://:{SECRET}{SECOND}:127.0.0.1/0",
    ],
)
def test_a_malformed_store_url_never_shows_its_credentials(url, caplog):
    from kvchat.tiers.redis import redact_url

    with caplog.at_level(logging.DEBUG), pytest.raises(ValueError) as raised:
        RedisTier(url)
    message = str(raised.value)
    for shown in (message, caplog.text, redact_url(url)):
        assert SECRET not in shown and SECOND not in shown, shown
    assert "redis://[[user]:password@]host[:port][/db]" in message, message


def test_a_good_store_url_is_shown_without_its_password():
    from kvchat.tiers.redis import redact_url

    assert redact_url(f"redis://u:{SECRET}@cache.local:6380/2") == "redis://***@cache.local:6380/2"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url(f"redis://h/0?password={SECRET}") == "redis://h/0?***"
    assert redact_url("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_kvchat_serve_does_not_print_the_store_password(tmp_path):
    from kvchat.serve.process import free_port

    url = f"redis://admin:{SECRET}/{SECOND}@127.0.0.1:6379/0"
    argv = [sys.executable, "-m", "kvchat.serve", "tiny", "--port", str(free_port())]
    done = subprocess.run(
        [*argv, "--store", url], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-2000:]
    for secret in (SECRET, SECOND, "admin"):
        assert secret not in output, output[-2000:]
    assert "is not a Redis URL" in output, output[-2000:]


# ------------------------------------------------ deletes, routes and outages
def test_a_delete_that_cannot_reach_redis_says_so_and_a_retry_deletes(llama, tokenizer):
    """Redis hung: remove() raises StoreUnavailable saying the session was
    removed here only (never a silent success that other processes would not
    see); while the store rests, nothing is removed; once Redis answers, the
    same call deletes it there, and another manager starts it from nothing."""
    with redis_server() as server:
        a, b = _two_managers(server.redis_url, llama, tokenizer, timeout=0.3, retry_after=0.5)
        messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
        _turns(a, "kept", [LONG_SYSTEM], llama, tokenizer, 1)
        with _hung(server):
            with pytest.raises(StoreUnavailable, match="'s' was removed here, but not in"):
                a.remove("s")
            assert a.sessions() == ["kept"]
            with pytest.raises(StoreUnavailable, match="'kept' was not removed"):
                a.remove("kept")  # the store is resting: nothing is removed
            with pytest.raises(StoreUnavailable, match="'kept' was not cleared"):
                a.clear("kept")
            assert a.messages("kept")[-1]["role"] == "assistant"
            assert a.sessions() == ["kept"]
        time.sleep(0.6)  # past retry_after
        a.remove("s")  # held only by the store now: deleted there
        manifests, _, _ = _keyspace(redis.Redis.from_url(server.redis_url))
        assert set(manifests) == {"kept"}, manifests.keys()
        _, reports = _turns(b, "s", messages, llama, tokenizer, 1, start=1)
        assert reports[0].reused_tokens == 0 and reports[0].reason != "store_reload"


def test_a_delete_the_store_cannot_carry_out_is_a_503_until_it_can(tokenizer):
    """`kvchat serve --store`, Redis hung: DELETE answers 503 (OpenAI-shaped,
    `store_unavailable`, saying to retry), never 200 for a delete the other
    replicas would not see; once Redis answers again, the retried DELETE
    answers 200 and nothing of the session is left in Redis."""
    import httpx
    from serving import Server, ask, client_for

    server = redis_server()
    flags = ("--store", server.redis_url, "--store-timeout", "0.3", "--api-key", "k")
    replica = Server("tiny:llama", *flags)
    auth = {"Authorization": "Bearer k"}
    try:
        ask(client_for(replica, "k"), [LONG_SYSTEM, user_message(0)], "s", stream=False)
        url = f"{replica.url}/v1/sessions/s"
        with _hung(server):
            response = httpx.delete(url, headers=auth, timeout=60)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "server_error",
            "store_unavailable",
            "session_id",
        ), error
        assert "try again" in error["message"] or "call again" in error["message"], error
        deadline = time.monotonic() + 60  # the tier rests 5 s after a failure
        while response.status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.5)
            response = httpx.delete(url, headers=auth, timeout=60)
        assert response.status_code == 200, response.text
        assert replica.get("/v1/sessions/s", "k").status_code == 404
        manifests, chunks, _ = _keyspace(redis.Redis.from_url(server.redis_url))
        assert not manifests and not chunks, (manifests.keys(), len(chunks))
    finally:
        replica.stop()
        server.stop()


def test_deletes_of_what_exists_nowhere_leave_nothing_behind(llama, tokenizer, server):
    """A DELETE of an id no process and no snapshot holds is a KeyError and
    writes nothing (no tombstone for every junk id), and no process remembers
    it; a real session's delete still reaches the process that holds a copy."""
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    client = redis.Redis.from_url(server.redis_url)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    messages, _ = _turns(b, "s", messages, llama, tokenizer, 1, start=1)
    keys = set(client.keys())
    for i in range(300):
        with pytest.raises(KeyError):
            b.remove(f"junk-{i}")
    assert set(client.keys()) == keys
    assert set(b.tier.copies.epochs) == {"s"}
    a.remove("s")
    _, reports = _turns(b, "s", messages, llama, tokenizer, 1, start=2)
    assert reports[0].reused_tokens == 0, reports


def test_a_fork_of_an_older_conversation_never_takes_a_session_over_on_any_replica(
    tokenizer, server
):
    """Two keyless replicas on one store. (1) A client continues its automatic
    session by X-Session-ID; a fork of the conversation it held before, sent
    to the other replica, gets a session of its own. (2) A conversation moves
    on on the other replica; a fork of its older point, sent back to the first
    replica (whose own map still has that point), gets one of its own too. In
    both, the first conversation's next turn reuses its whole history."""
    from serving import MAX_NEW as SERVE_MAX_NEW
    from serving import Server, client_for

    flags = ("--store", server.redis_url, "--api-key", "k")
    replicas = [Server("tiny:llama", *flags), Server("tiny:llama", *flags)]

    def ask(replica, messages, session=None):
        raw = client_for(replicas[replica], "k").chat.completions.with_raw_response.create(
            model="tiny:llama",
            messages=messages,
            max_tokens=SERVE_MAX_NEW,
            temperature=0,
            extra_headers={"X-Session-ID": session} if session else None,
        )
        completion = raw.parse()
        reply = {"role": "assistant", "content": completion.choices[0].message.content}
        return raw.headers["x-session-id"], [*messages, reply], completion.usage

    def fork(messages):
        return [*messages, {"role": "user", "content": "Something else entirely."}]

    try:
        for case, (continuer, forker) in enumerate([(0, 1), (1, 0)]):
            system = dict(LONG_SYSTEM, content=f"Case {case}. {LONG_SYSTEM['content']}")
            session, first, _ = ask(0, [system, user_message(0)])
            by_header = session if case == 0 else None
            same, history, usage = ask(continuer, [*first, user_message(1)], by_header)
            assert same == session
            forked, _, _ = ask(forker, fork(first))
            assert forked != session, f"case {case}: the fork took the session over"
            again, _, next_usage = ask(continuer, [*history, user_message(2)], by_header)
            assert again == session
            assert next_usage.prompt_tokens_details.cached_tokens > usage.prompt_tokens, case
    finally:
        for replica in replicas:
            replica.stop()


class _Replicas:
    """Two `kvchat serve` apps on one store, in this process (TestClient),
    keyless: each request names no session unless it says so."""

    def __init__(self, url: str, max_context_length: int | None = None, **tier_args):
        from fastapi.testclient import TestClient
        from kvchat.serve import ServeConfig, create_app

        self.managers, self.apps, self.clients = [], [], []
        for _ in range(2):
            manager = SessionManager(
                model_for("llama"),
                tiny_tokenizer(),
                isolate_namespaces=True,
                max_context_length=max_context_length,
                tier=RedisTier(url, **tier_args),
            )
            app = create_app(manager, ServeConfig(model_name="tiny"))
            self.managers.append(manager)
            self.apps.append(app)
            # Entered: one event loop serves every request, as in uvicorn.
            self.clients.append(TestClient(app).__enter__())

    def ask(self, replica: int, messages: list[dict], session: str | None = None, **body):
        """(the session it ran on, the messages with its reply, the response's usage)."""
        response = self.clients[replica].post(
            "/v1/chat/completions",
            json={"model": "tiny", "max_tokens": MAX_NEW, "messages": messages, **body},
            headers={"X-Session-ID": session} if session else {},
        )
        assert response.status_code == 200, response.text
        reply = response.json()["choices"][0]["message"]["content"]
        return (
            response.headers["x-session-id"],
            [*messages, {"role": "assistant", "content": reply}],
            response.json()["usage"],
        )

    def __enter__(self) -> _Replicas:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self):
        for client in self.clients:
            client.__exit__(None, None, None)
        for manager in self.managers:
            manager.close()


def _fork(messages: list[dict]) -> list[dict]:
    return [*messages, {"role": "user", "content": "Something else entirely."}]


def test_a_session_continued_by_its_id_on_another_replica_leaves_the_map_and_keeps_its_route(
    server,
):
    """A keyless conversation starts on A; its client continues it on B by
    X-Session-ID (B never made it). A fork of the conversation it held
    before, on either replica, gets a session of its own; the conversation's
    next keyless turn finds the session again, with its whole history."""
    # Not under test: whether a load beats a short prefill, nor a store that
    # rests after a call slowed past the default 0.5 s on a loaded machine.
    replicas = _Replicas(server.redis_url, timeout=5)
    for manager in replicas.managers:
        manager.tier.observe_prefill = lambda tokens, ms: None
    try:
        for forker in (0, 1):
            system = dict(LONG_SYSTEM, content=f"Fork on {forker}. {LONG_SYSTEM['content']}")
            session, first, _ = replicas.ask(0, [system, user_message(0)])
            same, history, usage = replicas.ask(1, [*first, user_message(1)], session)
            assert same == session
            forked, _, _ = replicas.ask(forker, _fork(first))
            assert forked != session, f"a fork on replica {forker} took the session over"
            again, _, next_usage = replicas.ask(0, [*history, user_message(2)])
            assert again == session, "the session's latest conversation lost its route"
            cached = next_usage["prompt_tokens_details"]["cached_tokens"]
            report = replicas.managers[0].last_turn(f"open/{again}")
            # B's snapshot, not A's older copy: all of B's prompt (and B's reply,
            # as far as its raw text re-tokenizes to what B generated).
            assert report.reason == "store_reload", (
                report,
                replicas.managers[0].tier.reader.misses,
            )
            assert cached >= usage["prompt_tokens"], (cached, usage, forker, report)
    finally:
        replicas.close()


@pytest.mark.parametrize("written", ["evict", "not yet"])
def test_a_delete_on_a_replica_holding_nothing_reaches_the_one_that_does(
    llama, tokenizer, server, written
):
    """A holds session "s"; no snapshot of it is in the store (``write="evict"``
    stores none until eviction; or A's snapshot is still being written). B's
    remove("s") deletes it (no KeyError): A's next turn starts it anew, and
    A's write, once it goes on, publishes nothing."""
    tier_args = {"write": "evict"} if written == "evict" else {}
    a, b = _two_managers(server.redis_url, llama, tokenizer, **tier_args)
    go = threading.Event()
    if written == "not yet":
        original = a.tier.writer.write

        def held_write(*args):
            assert go.wait(60)
            return original(*args)

        a.tier.writer.write = held_write
    try:
        messages = [LONG_SYSTEM, user_message(0)]
        messages.append(
            {"role": "assistant", "content": a.chat("s", messages, max_new_tokens=MAX_NEW)}
        )
        b.remove("s")
    finally:
        go.set()
    assert a.flush(timeout=60)
    manifests, chunks, _ = _keyspace(redis.Redis.from_url(server.redis_url))
    assert not manifests and not chunks, (manifests.keys(), len(chunks))
    _, reports = _turns(a, "s", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reused_tokens == 0, reports
    with pytest.raises(KeyError):
        b.remove("never-made")


def test_a_retried_delete_reaches_other_processes_though_the_store_forgot_the_session(
    llama, tokenizer
):
    """A and B each hold "s"; nothing of it is stored (``write="evict"``). A's
    remove("s") cannot reach Redis (removed here only: StoreUnavailable). The
    retry, once Redis is back, still deletes it everywhere, even though the
    store no longer knows the session (its held marker expired): B's next
    turn starts it anew."""
    with redis_server() as server:
        a, b = _two_managers(
            server.redis_url, llama, tokenizer, write="evict", timeout=0.3, retry_after=0.5
        )
        messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
        _turns(b, "s", [LONG_SYSTEM], llama, tokenizer, 1)
        with _hung(server):
            with pytest.raises(StoreUnavailable, match="'s' was removed here, but not in"):
                a.remove("s")
        client = redis.Redis.from_url(server.redis_url)
        for marker in client.scan_iter("*:held:*"):  # as if they had expired
            client.delete(marker)
        time.sleep(0.6)  # past retry_after
        a.remove("s")  # no KeyError: the delete is still owed
        _, reports = _turns(b, "s", messages, llama, tokenizer, 1, start=1)
        assert reports[0].reused_tokens == 0, reports


def _second_turn_during_an_outage(server, replicas):
    """A keyless conversation's first turn on A, then its second on A while
    Redis hangs (A's own map runs it): (the session, the conversation after
    the first turn, and after the second)."""
    session, first, _ = replicas.ask(0, [LONG_SYSTEM, user_message(0)])
    with _hung(server):
        same, second, _ = replicas.ask(0, [*first, user_message(1)])
    assert same == session
    return session, first, second


def test_a_route_written_during_an_outage_lands_once_redis_is_back(tokenizer):
    """A keyless conversation on A; Redis hangs while its next turn runs (A's
    own map stands in), so the store still routes the older conversation to
    the session. Once Redis answers, A pays the route change it owes: a fork
    of the older conversation, on B, gets a session of its own, and the
    conversation's next turn, on B, continues the session."""
    with redis_server() as server:
        with _Replicas(server.redis_url, timeout=0.3, retry_after=0.5) as replicas:
            session, first, history = _second_turn_during_an_outage(server, replicas)
            client = redis.Redis.from_url(server.redis_url)
            route = replicas.managers[0].tier.keys.route("open", conversation_digests(history)[-1])
            deadline = time.monotonic() + 30
            while not client.exists(route) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.get(route) == f"open/{session}".encode(), "the route never landed"
            forked, _, _ = replicas.ask(1, _fork(first))
            assert forked != session, "the fork took the session over after the outage"
            again, _, _ = replicas.ask(1, [*history, user_message(2)])
            assert again == session


def test_a_route_owed_during_an_outage_never_overrides_a_newer_one(tokenizer):
    """A owes a route change from an outage (its own map ran the turn); before
    it pays, B continues the session by its id, so B's route is the newer.
    A's late change is then not made: a fork of the conversation A held gets
    a session of its own, and the latest conversation continues the session."""
    with redis_server() as server:
        with _Replicas(server.redis_url, timeout=0.3, retry_after=2) as replicas:
            session, _, on_a = _second_turn_during_an_outage(server, replicas)
            again, on_b, _ = replicas.ask(1, [*on_a, user_message(2)], session)
            assert again == session
            time.sleep(2.5)  # A's rest ends: it pays what it owes (or finds it superseded)
            assert replicas.managers[0].flush(timeout=60)
            forked, _, _ = replicas.ask(1, _fork(on_a))
            assert forked != session, "A's late route let a fork take the session over"
            latest, _, _ = replicas.ask(0, [*on_b, user_message(3)])
            assert latest == session


def test_a_refused_turn_is_released_off_the_event_loop(server):
    """A turn refused after its claim (over the context) puts its route back
    in the store: that write, held up here as a hung store would hold it,
    never stalls the event loop (/health answers meanwhile)."""
    replicas = _Replicas(server.redis_url, max_context_length=256)
    tier, client = replicas.managers[0].tier, replicas.clients[0]
    try:
        _, first, _ = replicas.ask(0, [user_message(0)])
        entered, release, order = threading.Event(), threading.Event(), []
        original = tier.routes.remember

        def held(*args):
            entered.set()
            release.wait(30)
            order.append("route written")
            return original(*args)

        tier.routes.remember = held
        body = {"model": "tiny", "max_tokens": 10**6, "messages": [*first, user_message(1)]}
        refused = {}
        asking = threading.Thread(
            target=lambda: refused.setdefault("r", client.post("/v1/chat/completions", json=body))
        )
        asking.start()
        assert entered.wait(60)
        threading.Timer(10, release.set).start()  # unblocks a stalled loop, failing the test
        assert client.get("/health").status_code == 200
        order.append("health")
        release.set()
        asking.join(60)
        assert refused["r"].status_code == 400, refused["r"].text
        assert order == ["health", "route written"], order
    finally:
        release.set()
        replicas.close()


def test_a_copy_let_go_here_is_no_longer_found_by_a_delete(llama, tokenizer, server):
    """A's copy of "s" (nothing stored: ``write="evict"``) ends here only, as
    serve's idle expiry ends it: once A's writer has let its mark go (off the
    caller's thread: a delete in between finds a mark and leaves a tombstone of
    what nobody holds), a delete on B is a KeyError (404) and writes nothing."""
    a, b = _two_managers(server.redis_url, llama, tokenizer, write="evict")
    _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    a.remove("s", local_only=True)
    client = redis.Redis.from_url(server.redis_url)
    _wait_until(lambda: not client.exists(a.tier.keys.held("s")), "A let its mark go")
    keys = set(client.keys())
    with pytest.raises(KeyError):
        b.remove("s")
    assert not any(b":deleted:" in key for key in client.keys()), client.keys()
    assert set(client.keys()) <= keys


def test_a_copy_idle_past_the_store_ttl_is_still_reached_by_a_delete(llama, tokenizer, server):
    """A holds "s" (nothing stored: ``write="evict"``) and stays idle longer
    than the store's ttl: a delete on B still reaches it, and A's next turn
    starts the session anew."""
    a, b = _two_managers(server.redis_url, llama, tokenizer, write="evict", ttl=1)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    time.sleep(2.5)
    b.remove("s")
    _, reports = _turns(a, "s", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reused_tokens == 0, reports


def test_a_hung_store_never_blocks_the_event_loop():
    """Redis hung (SIGSTOP) while a keyless request asks it for its route (a
    5 s timeout): the server still answers /health at once meanwhile, and
    the request then runs without the store."""
    import httpx
    from serving import Server

    server = redis_server()
    replica = Server("tiny:llama", "--store", server.redis_url, "--store-timeout", "5")
    try:
        earlier = [user_message(0), {"role": "assistant", "content": "Hello."}]
        body = {"model": "tiny:llama", "max_tokens": 2, "messages": [*earlier, user_message(1)]}
        done = {}
        with _hung(server):
            asking = threading.Thread(
                target=lambda: done.setdefault(
                    "chat", httpx.post(f"{replica.url}/v1/chat/completions", json=body, timeout=60)
                )
            )
            asking.start()
            time.sleep(1)  # the request is waiting on Redis now
            health = httpx.get(f"{replica.url}/health", timeout=3)
            assert health.status_code == 200
            assert "chat" not in done, "the request did not wait on the hung store"
        asking.join(60)
        assert done["chat"].status_code == 200, done["chat"].text
    finally:
        replica.stop()
        server.stop()


def test_a_replica_keeps_nothing_of_another_replicas_session_its_turn_refused(tokenizer, server):
    """Conversations started on replica A; each continuation on B is refused
    (over the context): B's router keeps nothing of those sessions, and each
    route is back in the store, so A continues every conversation."""
    replicas = _Replicas(server.redis_url, max_context_length=256)
    manager_b, (a, b) = replicas.managers[1], replicas.clients
    body = {"model": "tiny", "max_tokens": 2}
    try:
        for i in range(5):
            messages = [user_message(i)]
            made = a.post("/v1/chat/completions", json={**body, "messages": messages})
            assert made.status_code == 200, made.text
            reply = made.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": reply}, user_message(i + 1)]
            refused = b.post(
                "/v1/chat/completions", json={**body, "messages": messages, "max_tokens": 10**6}
            )
            assert refused.status_code == 400, refused.text
            again = a.post("/v1/chat/completions", json={**body, "messages": messages})
            assert again.headers["x-session-id"] == made.headers["x-session-id"]
        assert manager_b.sessions() == []
        assert replicas.apps[1].state.router.tracked() == set()
    finally:
        replicas.close()


def _wait_until(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def test_a_take_owed_by_a_replica_that_never_saw_the_session_is_still_made(tokenizer):
    """A keyless conversation starts on A (its route is in the store). Redis
    hangs while its client continues it on B by X-Session-ID (B never saw the
    session, so B owes the route's removal). Once Redis answers, B makes it:
    a fork of the conversation A held gets a session of its own."""
    with redis_server() as server:
        with _Replicas(server.redis_url, timeout=0.3, retry_after=0.5) as replicas:
            session, first, _ = replicas.ask(0, [LONG_SYSTEM, user_message(0)])
            with _hung(server):
                same, _, _ = replicas.ask(1, [*first, user_message(1)], session)
            assert same == session
            tier_b = replicas.managers[1].tier
            _wait_until(lambda: tier_b.owed_routes() == 0, "B paid what it owed")
            forked, _, _ = replicas.ask(0, _fork(first))
            assert forked != session, "B's owed take was dropped: a fork took the session over"


def test_a_copy_idle_while_its_delete_expires_is_still_dropped(llama, tokenizer, server):
    """A holds "s"; B deletes it; A stays idle longer than the tombstone lives
    (the store's ttl). A's next turn still starts the session anew."""
    a, b = _two_managers(server.redis_url, llama, tokenizer, ttl=1)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    b.remove("s")
    client = redis.Redis.from_url(server.redis_url)
    _wait_until(lambda: not client.exists(a.tier.keys.tombstone("s")), "the tombstone expired")
    _, reports = _turns(a, "s", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reused_tokens == 0, reports


def _before(tier, name: str, hook) -> None:
    """Runs ``hook()`` once, on the writer thread, just before the tier's Lua
    script ``name`` runs there: the moment another thread could act."""
    script, done = getattr(tier.conn, name), threading.Event()

    def wrapped(*args, **kwargs):
        if threading.current_thread() is tier.writer.thread and not done.is_set():
            done.set()
            hook()
        return script(*args, **kwargs)

    setattr(tier.conn, name, wrapped)


def test_a_mark_let_go_during_a_refresh_stays_gone(llama, tokenizer, server):
    """A holds "s" and "t"; its copy of "s" is let go (local_only) just as the
    writer refreshes the held marks: the refresh does not bring the mark of
    "s" back, so a delete on B is a KeyError (404)."""
    a, b = _two_managers(server.redis_url, llama, tokenizer, write="evict", ttl=2)
    for session in ("s", "t"):
        _turns(a, session, [LONG_SYSTEM], llama, tokenizer, 1)
    let_go = threading.Event()
    _before(a.tier, "refresh", lambda: (a.remove("s", local_only=True), let_go.set()))
    assert let_go.wait(30)
    client = redis.Redis.from_url(server.redis_url)
    _wait_until(lambda: not a.tier.copies.releasing, "the release was made")
    assert not client.exists(a.tier.keys.held("s")), "the refresh brought the mark back"
    with pytest.raises(KeyError):
        b.remove("s")


def _on_a_thread(work) -> None:
    """Runs ``work`` on a thread of its own, as a request would, and waits for
    it (called from the writer thread, which then waits)."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)


def _a_delete_on_b_reaches_a(a, b, server, messages, model, tokenizer) -> None:
    """A holds a copy of "s" (its third turn comes next): its mark is in Redis,
    B's delete reaches it, and A's next turn starts the session anew."""
    client = redis.Redis.from_url(server.redis_url)
    assert client.exists(a.tier.keys.held("s")), "the new copy's mark was removed"
    b.remove("s")
    _, reports = _turns(a, "s", messages, model, tokenizer, 1, start=2)
    assert reports[0].reused_tokens == 0, reports


def test_a_copy_begun_again_keeps_its_mark_when_the_last_copy_is_let_go(llama, tokenizer, server):
    """A's copy of "s" ends here (local_only) and, before the writer removes
    its mark, "s" begins again here: the late removal leaves the new copy's
    mark, so a delete on B still reaches A (no KeyError) and A starts anew."""
    a, b = _two_managers(server.redis_url, llama, tokenizer, write="evict")
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    begin_again = lambda: _turns(a, "s", messages, llama, tokenizer, 1, 1)  # noqa: E731
    _before(a.tier, "release", lambda: _on_a_thread(begin_again))
    a.remove("s", local_only=True)
    _wait_until(
        lambda: not a.tier.copies.releasing and "s" in a.sessions(), "began again, released"
    )
    _a_delete_on_b_reaches_a(a, b, server, messages, llama, tokenizer)


def test_idle_expiry_never_waits_on_the_store_under_its_lock(llama, tokenizer, server):
    """serve's idle expiry lets a copy go (local_only) under its own lock, the
    one every request takes as it begins and ends: no Redis call is made on
    that thread while the lock is held, as a hung store would hold it."""
    from kvchat.serve.expiry import IdleExpiry
    from kvchat.serve.sessions import SessionRouter

    manager = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url, write="evict"))
    expiry = IdleExpiry(manager, SessionRouter(manager), ttl=60)
    _turns(manager, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    tier, sweeper, under_lock = manager.tier, threading.current_thread(), []

    class Watched:
        def __getattr__(self, name):
            if threading.current_thread() is sweeper:
                under_lock.append((name, expiry._lock.locked()))
            return getattr(real, name)

    real, tier.conn.client = tier.conn.client, Watched()
    with expiry._lock:
        expiry._last["s"] = time.monotonic() - 120
    assert expiry.sweep() == 1
    assert manager.sessions() == []
    assert not [call for call in under_lock if call[1]], under_lock
    tier.conn.client = real
    _wait_until(lambda: not real.exists(tier.keys.held("s")), "the mark went (off that thread)")


def test_a_deleted_session_leaves_no_route_generation_behind(llama, tokenizer, server):
    """The route generations a tier remembers go with the session: deleted,
    or let go here with nothing owed."""
    a = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url))
    for session in ("s", "t"):
        _turns(a, session, [LONG_SYSTEM], llama, tokenizer, 1)
        a.tier.routes.remember("open", f"conversation of {session}", session)
    assert {"s", "t"} <= set(a.tier.routes.gens)
    a.remove("s")
    a.remove("t", local_only=True)
    assert not {"s", "t"} & set(a.tier.routes.gens), a.tier.routes.gens


def test_a_route_is_put_back_outside_the_routers_lock(server):
    """A turn on another replica's session refused here puts its route back
    in the store; that store call is never made holding the router's lock
    (every claim and release of every session takes it)."""
    replicas = _Replicas(server.redis_url, max_context_length=256)
    tier, router = replicas.managers[1].tier, replicas.apps[1].state.router
    seen, original = [], tier.routes.remember

    def watched(*args):
        seen.append(router._lock.locked())
        return original(*args)

    tier.routes.remember = watched
    try:
        _, first, _ = replicas.ask(0, [user_message(0)])
        body = {"model": "tiny", "max_tokens": 10**6, "messages": [*first, user_message(1)]}
        refused = replicas.clients[1].post("/v1/chat/completions", json=body)
        assert refused.status_code == 400, refused.text
        assert seen == [False], seen
    finally:
        replicas.close()


def test_a_route_owed_at_close_is_made_before_the_writer_stops(llama, tokenizer):
    """A route change owed during an outage, with Redis back but the tier
    still resting, is made by close(): it is not lost with the process."""
    with redis_server() as server:
        tier = RedisTier(server.redis_url, timeout=0.3, retry_after=1)
        SessionManager(llama, tokenizer, tier=tier)
        with _hung(server):
            tier.routes.remember("open", "a conversation", "open/s")
        assert tier.owed_routes() == 1
        tier.close()
        client = redis.Redis.from_url(server.redis_url)
        assert client.get(tier.keys.route("open", "a conversation")) == b"open/s"


def test_held_marks_are_kept_alive_while_snapshots_keep_coming(llama, tokenizer, server):
    """A steady queue of snapshots to write never starves the refresh of the
    held marks: a copy held here stays marked past the store's ttl."""
    manager = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url, ttl=1))
    _turns(manager, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    tier, original = manager.tier, manager.tier.writer.write
    tier.writer.write = lambda *args: time.sleep(
        0.2
    )  # a slow write (what it writes does not matter)
    client = redis.Redis.from_url(server.redis_url)
    try:
        for i in range(30):  # 3 s of snapshots, always one queued
            tier.writer.enqueue(f"other-{i % 3}", ({"layers": []}, {}, [], None))
            time.sleep(0.1)
            assert client.exists(tier.keys.held("s")), f"the mark expired after {i / 10:.1f} s"
    finally:
        assert manager.flush(timeout=60)
        tier.writer.write = original


def test_a_session_used_again_after_a_delete_outlives_that_tombstone(llama, tokenizer, server):
    """ "s" is cleared (or deleted) and used again under the same id: its copy
    began under that tombstone. Once the tombstone expires, nothing has
    deleted the session: it stays, with its history."""
    a = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url, ttl=2))
    _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    a.clear("s")
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    client = redis.Redis.from_url(server.redis_url)
    _wait_until(lambda: not client.exists(a.tier.keys.tombstone("s")), "the tombstone expired")
    refreshed = a.tier.copies.next_refresh
    _wait_until(lambda: a.tier.copies.next_refresh > refreshed + 0.1, "a refresh after it")
    assert not a.drop_if_deleted("s")
    assert a.sessions() == ["s"]
    _, reports = _turns(a, "s", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reused_tokens > 0, reports


def test_routes_stay_right_through_two_outages_on_one_session(tokenizer):
    """A keyless session starts on A while Redis hangs; its route is paid once
    Redis is back. A second outage: its next turn on A owes a take, then a
    route. Once paid, a fork of the older conversation, on B, gets a session
    of its own, and the latest conversation continues the session."""
    with redis_server() as server:
        replicas = _Replicas(server.redis_url, timeout=0.3, retry_after=0.5)
        tier = replicas.managers[0].tier
        try:
            with _hung(server):
                session, first, _ = replicas.ask(0, [LONG_SYSTEM, user_message(0)])
            _wait_until(lambda: tier.owed_routes() == 0, "the first route was paid")
            with _hung(server):
                same, second, _ = replicas.ask(0, [*first, user_message(1)])
            assert same == session
            _wait_until(lambda: tier.owed_routes() == 0, "the second outage's changes were paid")
            forked, _, _ = replicas.ask(1, _fork(first))
            assert forked != session, "a fork of the older conversation took the session over"
            latest, _, _ = replicas.ask(1, [*second, user_message(2)])
            assert latest == session, "the latest conversation lost its route"
        finally:
            replicas.close()


def test_a_copy_known_deleted_is_dropped_though_redis_hangs_as_its_turn_begins(
    llama, tokenizer, server
):
    """A holds "s"; B deletes it, and A's refresh of its marks sees the
    tombstone, which then expires. Redis hangs as A's next turn on "s"
    begins: the turn still starts the session anew."""
    tier_args = {"ttl": 2, "timeout": 0.3, "retry_after": 0.3}
    a, b = _two_managers(server.redis_url, llama, tokenizer, **tier_args)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    b.remove("s")
    client = redis.Redis.from_url(server.redis_url)
    _wait_until(lambda: a.tier.copies.deleted("s", None), "A's refresh saw the tombstone")
    _wait_until(lambda: not client.exists(a.tier.keys.tombstone("s")), "the tombstone expired")
    with _hung(server):
        a.chat("s", [*messages, user_message(1)], max_new_tokens=MAX_NEW)
    assert a.last_turn("s").reused_tokens == 0, a.last_turn("s")


def test_close_keeps_to_its_timeout_with_redis_hung(llama, tokenizer):
    """close(timeout=2) with Redis hung and a route change and a mark
    removal owed: it returns within the timeout (what is owed is lost, as
    the docstring says), and the writer has stopped."""
    with redis_server() as server:
        manager = SessionManager(
            llama, tokenizer, tier=RedisTier(server.redis_url, timeout=0.3, retry_after=5)
        )
        _turns(manager, "s", [LONG_SYSTEM], llama, tokenizer, 1)
        with _hung(server):
            manager.tier.routes.remember("open", "a conversation", "s")
            manager.remove("s", local_only=True)
            started = time.monotonic()
            manager.tier.close(timeout=2)
            took = time.monotonic() - started
        assert took < 2.7, f"close(timeout=2) took {took:.2f} s"
        _wait_until(lambda: not manager.tier.writer.thread.is_alive(), "the writer ended", 5)


def _hung_while_its_turn_begins(tier, server):
    """Redis hangs (SIGSTOP) only while the next turn reads its tombstone, and
    is back (its rest over) when the turn goes on."""
    original = tier.deleted_since

    def once(*args, **kwargs):
        tier.deleted_since = original
        with _hung(server):
            found = original(*args, **kwargs)
        time.sleep(0.15)  # past retry_after
        return found

    tier.deleted_since = once


@pytest.mark.parametrize("write", ["turn", "evict"])
def test_a_delete_reaches_a_copy_begun_while_redis_could_not_answer(
    llama, tokenizer, server, write
):
    """A's first turn on "s" begins while Redis hangs, so A cannot know which
    tombstone it began under; Redis is back for the rest of the turn. A delete
    on B still reaches A (no KeyError, though nothing may be stored), A's next
    turn starts the session anew, and A publishes nothing of the deleted copy."""
    a = SessionManager(
        llama,
        tokenizer,
        tier=RedisTier(server.redis_url, write=write, timeout=0.3, retry_after=0.1),
    )
    b = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url, write=write))
    _hung_while_its_turn_begins(a.tier, server)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    client = redis.Redis.from_url(server.redis_url)
    _wait_until(
        lambda: client.exists(a.tier.keys.held("s")), "A marked its copy once Redis was back"
    )
    b.remove("s")
    _, reports = _turns(a, "s", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reused_tokens == 0, reports


def _during_a_refresh(manager, work) -> None:
    """Runs ``work`` on another thread (as a request would) while the writer
    refreshes the held marks, between its read of them and its Lua script:
    the writer waits for it. Returns once that refresh has begun and
    ``work`` is done."""
    done = threading.Event()
    _before(manager.tier, "refresh", lambda: (_on_a_thread(work), done.set()))
    with manager.tier.cond:
        manager.tier.copies.next_refresh = 0
        manager.tier.cond.notify_all()
    assert done.wait(60)


def test_a_mark_is_removed_when_its_copy_is_let_go_after_a_racing_refresh(llama, tokenizer, server):
    """A turn of A's copy of "s" begins while the writer refreshes the marks;
    the copy is then let go (as idle expiry does): its mark goes, so a delete
    on B of what nobody holds is a KeyError (404)."""
    a, b = _two_managers(server.redis_url, llama, tokenizer, write="evict", ttl=60)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    _during_a_refresh(a, lambda: _turns(a, "s", messages, llama, tokenizer, 1, 1))
    a.remove("s", local_only=True)
    _wait_until(lambda: not a.tier.copies.releasing, "the release was made")
    client = redis.Redis.from_url(server.redis_url)
    assert not client.exists(a.tier.keys.held("s")), client.get(a.tier.keys.held("s"))
    with pytest.raises(KeyError):
        b.remove("s")


def test_a_copy_begun_again_during_a_refresh_keeps_its_mark(llama, tokenizer, server):
    """While the writer refreshes the marks, A's copy of "s" is let go and
    begins again: the refresh does not put back the old copy's mark, so its
    removal leaves the new copy's, and a delete on B reaches A."""
    a, b = _two_managers(server.redis_url, llama, tokenizer, write="evict", ttl=60)
    messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)

    def let_go_and_begin_again():
        a.remove("s", local_only=True)
        _turns(a, "s", messages, llama, tokenizer, 1, 1)

    _during_a_refresh(a, let_go_and_begin_again)
    _wait_until(lambda: not a.tier.copies.releasing, "the release was made")
    _a_delete_on_b_reaches_a(a, b, server, messages, llama, tokenizer)


def test_a_copy_known_deleted_is_dropped_by_get_though_redis_hangs(llama, tokenizer, server):
    """A's marks' refresh saw "s" deleted; then Redis hangs: serve's GET and
    listing (drop_if_deleted) still drop the copy, as a turn would."""
    a, b = _two_managers(server.redis_url, llama, tokenizer, ttl=1, timeout=0.3)
    _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
    b.remove("s")
    _wait_until(lambda: a.tier.copies.deleted("s", None), "A's refresh saw the delete")
    with _hung(server):
        dropped = a.drop_if_deleted("s")
    assert dropped and "s" not in a.sessions(), "a copy known deleted is still served"


@pytest.mark.parametrize("write", ["turn", "evict"])
def test_a_copy_begun_in_a_long_outage_is_marked_soon_after_it(llama, tokenizer, server, write):
    """A's first turn on "s" runs while Redis hangs, and the outage lasts past
    retry_after, so A's writer fails to mark the copy once. Redis is then
    back: the writer marks it within moments, not a ttl / 4 later, so a delete
    on B reaches A and A's next turn starts anew."""
    a = SessionManager(
        llama,
        tokenizer,
        tier=RedisTier(server.redis_url, write=write, ttl=60, timeout=0.3, retry_after=0.5),
    )
    b = SessionManager(llama, tokenizer, tier=RedisTier(server.redis_url, write=write, ttl=60))
    with _hung(server):
        messages, _ = _turns(a, "s", [LONG_SYSTEM], llama, tokenizer, 1)
        time.sleep(2.0)  # the writer's try, at the end of the rest, fails
    client = redis.Redis.from_url(server.redis_url)
    _wait_until(lambda: client.exists(a.tier.keys.held("s")), "A marked its copy", 10)
    b.remove("s")
    _, reports = _turns(a, "s", messages, llama, tokenizer, 1, start=1)
    assert reports[0].reused_tokens == 0, reports


def test_a_route_change_counts_as_owed_until_it_is_made(llama, tokenizer):
    """owed_routes() (what a caller waits on before relying on the store's
    routes) counts a change owed during an outage until the writer has made
    it, not from the moment the writer takes it up."""
    with redis_server() as server:
        tier = RedisTier(server.redis_url, timeout=0.3, retry_after=0.5)
        SessionManager(llama, tokenizer, tier=tier)
        with _hung(server):
            tier.routes.take_session("open/s")
        assert tier.owed_routes() == 1
        seen = []
        _before(tier, "take_session", lambda: seen.append(tier.owed_routes()))
        _wait_until(lambda: seen and tier.owed_routes() == 0, "the writer made the change")
        assert seen == [1], seen
        tier.close()


def test_a_shorter_lived_put_never_ends_a_keys_bounds_under_longer_lived_records(
    llama, tokenizer, server
):
    """Replicas with different --session-ttl on one Redis: a put that lives
    0.3 s beside a record that lives an hour left the key's index and sizes
    to expire with the short one, so the long-lived record escaped its key's
    bounds and the totals (found by an attack on the per-key store)."""
    a, b = _two_managers(server.redis_url, llama, tokenizer)
    long_lived = _stored_responses(a, 2, 10_000, ttl=3600)
    short_lived = _stored_responses(b, 2, 10_000, ttl=0.3)
    assert long_lived.put("key-m", "old-live", {"n": 0}, [])
    assert short_lived.put("key-m", "brief", {"n": 1}, [])
    time.sleep(0.6)  # "brief" is gone; "old-live" is not
    assert long_lived.get("key-m", "old-live") is not None
    long_lived.put("key-m", "m2", {"n": 2}, [])
    long_lived.put("key-m", "m3", {"n": 3}, [])  # past the key's 2: its oldest went
    assert long_lived.get("key-m", "old-live") is None
    assert long_lived.totals() == (2, sum(_record_bytes({"n": n}, []) for n in (2, 3)))
