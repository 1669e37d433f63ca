"""KV cache events published over ZeroMQ, on vLLM's wire protocol.

Three groups: the publisher alone (sockets, no engine); the engine core on the
simulated runner (one batch per step, nothing left in the scheduler); and the
offline ``LLM`` on the real default model, read by a real SUB socket.

PUB/SUB drops whatever is sent before the subscription reaches the publisher
(the "slow joiner"), so every subscriber first waits until a probe batch
arrives; every wait here is bounded.
"""

import threading
import time

import msgspec
import pytest
import zmq

from cadence.config import CacheConfig, SchedulerConfig
from cadence.core.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored
from cadence.core.kv_cache.hashing import ROOT_HASH, builtin_block_hash
from cadence.core.request import Request
from cadence.core.sched.scheduler import Scheduler
from cadence.engine.core import EngineCore
from cadence.engine.kv_events import (
    END_SEQ,
    KVEventBatch,
    ZmqEventPublisher,
    binds,
    decode_seq,
    encode_seq,
    publisher_for,
)
from cadence.sampling_params import SamplingParams
from cadence.sim.runner import SimRunner

TIMEOUT_S = 10.0
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def wait_until(condition, timeout=TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def subscriber(ctx, topic: str, *, connect: str | None = None):
    """A SUB socket on ``topic``: connected to ``connect``, else bound to a free
    local port (returned with it, for a publisher that connects)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.setsockopt(zmq.LINGER, 0)
    if connect is not None:
        sub.connect(connect)
        return sub, None
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    return sub, f"tcp://127.0.0.1:{port}"


def receive(sub, timeout=TIMEOUT_S) -> tuple[bytes, int, KVEventBatch]:
    assert sub.poll(int(timeout * 1000)), "no message"
    topic, seq, payload = sub.recv_multipart()
    return topic, decode_seq(seq), DECODER.decode(payload)


def join(sub, probe) -> None:
    """Call ``probe()`` (which publishes one batch and returns its seq, or None
    when unknown) until ``sub`` receives one, then read every probe sent after it."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        last_seq = probe()
        if sub.poll(50):
            break
        assert time.monotonic() < deadline, "the subscriber never joined"
    while last_seq is not None and receive(sub)[1] != last_seq:
        pass


def probe_batch() -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[AllBlocksCleared()])


def stored_batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=float(i), events=[BlockStored([i], i - 1, [i] * 4, 4), BlockRemoved([i - 1])])


def replay(ctx, endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for batches from ``start_seq``; (seq, payload) up to
    and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", encode_seq(start_seq)])
    replies = []
    while not replies or replies[-1][0] != -1:
        assert dealer.poll(int(TIMEOUT_S * 1000)), "replay did not answer"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        replies.append((decode_seq(seq), payload))
    dealer.close()
    return replies


# ---------------------------------------------------------------- the publisher alone


@pytest.mark.parametrize("endpoint, bound", [
    ("tcp://*:5557", True), ("tcp://0.0.0.0:5557", True), ("tcp://[::]:5557", True),
    ("ipc:///tmp/kv", True), ("inproc://kv", True), ("tcp://127.0.0.1:5557", False),
    ("tcp://router.local:5557", False),
])
def test_wildcards_and_local_transports_bind_others_connect(endpoint, bound):
    assert binds(endpoint) is bound


def test_sequence_frames_are_8_byte_big_endian_and_end_is_minus_one():
    assert encode_seq(258) == b"\0\0\0\0\0\0\1\2"
    assert decode_seq(encode_seq(12345)) == 12345
    assert decode_seq(END_SEQ) == -1 and END_SEQ == b"\xff" * 8


def test_batches_encode_as_arrays_that_two_field_readers_decode():
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(1.5, [], 2))) == [1.5, [], 2]

    class TwoFieldBatch(msgspec.Struct, array_like=True):
        ts: float
        events: list

    payload = msgspec.msgpack.encode(KVEventBatch(1.5, [AllBlocksCleared()]))
    assert msgspec.msgpack.decode(payload, type=TwoFieldBatch).ts == 1.5
    assert DECODER.decode(payload) == KVEventBatch(1.5, [AllBlocksCleared()])


def test_subscriber_receives_topic_seq_and_batch_in_order(ctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv.pub"
    publisher = ZmqEventPublisher(endpoint, topic="kv")
    try:
        sub, _ = subscriber(ctx, "kv", connect=endpoint)
        join(sub, lambda: publisher.publish(probe_batch()))
        first = publisher.publish(stored_batch(1))
        sent = [stored_batch(i) for i in range(1, 6)]
        assert [publisher.publish(b) for b in sent[1:]] == [first + 1, first + 2, first + 3, first + 4]
        for i, batch in enumerate(sent):
            topic, seq, received = receive(sub)
            assert (topic, seq, received) == (b"kv", first + i, batch)
    finally:
        publisher.close()
    assert publisher.num_sent == first + 5 and publisher.num_dropped == 0


def test_sequence_numbers_start_at_zero_and_replay_resends_from_any_seq(ctx, tmp_path):
    replay_endpoint = f"ipc://{tmp_path}/kv.replay"
    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/kv.pub", replay_endpoint=replay_endpoint,
                                  buffer_steps=100)
    try:
        assert [publisher.publish(stored_batch(i)) for i in range(6)] == list(range(6))
        wait_until(lambda: publisher.num_sent == 6)
        replies = replay(ctx, replay_endpoint, 0)
        assert [seq for seq, _ in replies] == [0, 1, 2, 3, 4, 5, -1]
        assert [DECODER.decode(p) for _, p in replies[:-1]] == [stored_batch(i) for i in range(6)]
        assert replies[-1] == (-1, b"")
        assert [seq for seq, _ in replay(ctx, replay_endpoint, 4)] == [4, 5, -1]
        assert replay(ctx, replay_endpoint, 6) == [(-1, b"")]
    finally:
        publisher.close()


def test_the_replay_buffer_keeps_only_the_last_buffer_steps_batches(ctx, tmp_path):
    replay_endpoint = f"ipc://{tmp_path}/kv.replay"
    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/kv.pub", replay_endpoint=replay_endpoint,
                                  buffer_steps=4)
    try:
        for i in range(10):
            publisher.publish(stored_batch(i))
        wait_until(lambda: publisher.num_sent == 10)
        assert [seq for seq, _ in replay(ctx, replay_endpoint, 0)] == [6, 7, 8, 9, -1]
    finally:
        publisher.close()


def test_a_full_queue_drops_its_oldest_batches_and_leaves_a_gap(ctx, tmp_path):
    replay_endpoint = f"ipc://{tmp_path}/kv.replay"
    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/kv.pub", replay_endpoint=replay_endpoint,
                                  max_queue_size=2)
    gate = threading.Event()
    send = publisher._send
    publisher._send = lambda *args: (gate.wait(TIMEOUT_S), send(*args))  # hold the sender
    try:
        publisher.publish(stored_batch(0))
        wait_until(lambda: not publisher._queue)  # seq 0 taken, the sender waits at the gate
        for i in range(1, 6):
            publisher.publish(stored_batch(i))
        assert publisher.num_dropped == 3 and len(publisher._queue) == 2
        gate.set()
        wait_until(lambda: publisher.num_sent == 3)
        assert [seq for seq, _ in replay(ctx, replay_endpoint, 0)] == [0, 4, 5, -1]
    finally:
        gate.set()
        publisher.close()


def test_close_stops_publishing_and_a_busy_address_fails_at_once(ctx, tmp_path):
    publisher = ZmqEventPublisher("tcp://127.0.0.1:1")  # connects: nothing needs to listen
    publisher.close()
    assert publisher.publish(probe_batch()) is None
    publisher.close()  # twice is harmless
    _, busy = subscriber(ctx, "")  # a port held by another socket
    with pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(f"ipc://{tmp_path}/kv.pub", replay_endpoint=busy)


def test_publisher_for_follows_the_cache_options(tmp_path):
    assert publisher_for(CacheConfig()) is None
    config = CacheConfig(enable_kv_cache_events=True, kv_events_endpoint=f"ipc://{tmp_path}/p",
                         kv_events_topic="t", kv_events_buffer_steps=3)
    publisher = publisher_for(config)
    try:
        assert (publisher.endpoint, publisher.topic) == (f"ipc://{tmp_path}/p", "t")
        assert publisher._buffer.maxlen == 3
    finally:
        publisher.close()


@pytest.mark.parametrize("options", [
    {"kv_events_endpoint": "localhost:5557"}, {"kv_events_replay_endpoint": "5558"},
    {"kv_events_buffer_steps": 0},
])
def test_invalid_event_options_name_the_field(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        CacheConfig(**options)


# ---------------------------------------------------------------- the engine core (simulated runner)


class NoCost:
    def step_seconds(self, shape) -> float:
        return 0.0


class RecordingPublisher:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self.closed = False

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def close(self) -> None:
        self.closed = True


def sim_core(publisher=None) -> EngineCore:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256),
        CacheConfig(block_size=4, num_gpu_blocks=12, enable_kv_cache_events=True),
    )
    return EngineCore(scheduler, SimRunner(NoCost()), event_publisher=publisher)


def run_prompts(core: EngineCore, num_prompts: int) -> None:
    """Distinct 10-token prompts, two at a time; after every step the scheduler holds no event."""
    for i in range(0, num_prompts, 2):
        for j in (i, i + 1):
            prompt = list(range(100 * j, 100 * j + 10))
            core.add_request(Request(str(j), prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
        while core.has_work():
            core.step()
            assert core.scheduler.kv_events == []
            assert core.scheduler.kv_cache_manager.take_events() == []


def test_each_step_publishes_its_events_as_one_batch():
    publisher = RecordingPublisher()
    core = sim_core(publisher)
    run_prompts(core, 2)
    assert publisher.batches and all(batch.events for batch in publisher.batches)
    stored = [e for batch in publisher.batches for e in batch.events if isinstance(e, BlockStored)]
    # Each request computes 10 prompt + 2 output tokens: three full blocks of 4.
    assert sorted(e.token_ids[0] for e in stored) == [0, 4, 8, 100, 104, 108]
    assert core.reset_prefix_cache() is True
    assert publisher.batches[-1].events == [AllBlocksCleared()]  # now, not at the next step
    core.shutdown()
    assert publisher.closed


def test_evictions_are_published():
    publisher = RecordingPublisher()
    run_prompts(sim_core(publisher), 6)  # 18 cached blocks through a 12-block cache
    assert any(isinstance(e, BlockRemoved) for batch in publisher.batches for e in batch.events)


def test_without_a_publisher_events_are_drained_and_dropped():
    core = sim_core()
    run_prompts(core, 20)  # asserts the scheduler is empty after every step
    assert core.num_steps >= 40
    assert core.scheduler.kv_cache_manager.block_pool.cached_blocks  # events were recorded
    assert core.reset_prefix_cache() is True
    assert core.scheduler.take_kv_events() == []


# ---------------------------------------------------------------- the offline LLM, real model

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def zmq_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def llm_and_sub(zmq_context):
    """An LLM whose publisher connects to a SUB bound here, joined; 8 blocks of 16 tokens."""
    from cadence.engine import LLM

    sub, endpoint = subscriber(zmq_context, "kv")
    llm = LLM(dtype="float32", enable_kv_cache_events=True, kv_events_endpoint=endpoint,
              kv_events_topic="kv", num_gpu_blocks=8, max_num_seqs=2)
    core = llm.engine.core
    try:
        assert isinstance(core.event_publisher, ZmqEventPublisher)
        join(sub, lambda: probe_with_a_reset(core))
        yield llm, sub
    finally:
        core.shutdown()


def probe_with_a_reset(core: EngineCore) -> None:
    assert core.reset_prefix_cache()  # an idle engine: always accepted, always published


def receive_until(sub, wanted) -> list:
    """Events of the batches received until one holds an event ``wanted`` accepts."""
    events = []
    while not any(wanted(e) for e in events):
        topic, _, batch = receive(sub)
        assert topic == b"kv"
        events += batch.events
    return events


def distinct_prompt(i: int) -> list[int]:
    """40 tokens: two full blocks and a partial one."""
    return [1000 + 100 * i + t for t in range(40)]


def block_hashes_of(prompt: list[int]) -> list[int]:
    """The chained hashes of the prompt's full blocks (builtin hash, no LoRA)."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = builtin_block_hash(parent, tuple(prompt[start:start + BLOCK_SIZE]), None)
        hashes.append(parent)
    return hashes


def generate(llm, prompt):
    llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert llm.scheduler.kv_events == []  # drained every step


def test_a_generation_publishes_its_full_prompt_blocks(llm_and_sub):
    llm, sub = llm_and_sub
    prompt = distinct_prompt(0)
    generate(llm, prompt)
    events = receive_until(sub, lambda e: isinstance(e, BlockStored) and e.token_ids == prompt[16:32])
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [prompt[:16], prompt[16:32]]
    assert all(e.block_size == BLOCK_SIZE for e in stored)
    assert [h for e in stored for h in e.block_hashes] == block_hashes_of(prompt)
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]


def test_evictions_publish_block_removed_for_stored_blocks(llm_and_sub):
    llm, sub = llm_and_sub
    removed = []
    for i in range(1, 6):  # 3 blocks each (2 cached) through an 8-block cache: the 3rd evicts
        prompt = distinct_prompt(i)
        generate(llm, prompt)
        events = receive_until(sub, lambda e: isinstance(e, BlockStored) and e.token_ids == prompt[16:32])
        removed += [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        if removed:
            break
    assert removed, "no eviction was published"
    # Only blocks published as stored before (by this test or the one above) are removed.
    published = {h for i in range(6) for h in block_hashes_of(distinct_prompt(i))}
    assert set(removed) <= published and len(set(removed)) == len(removed)


def test_reset_prefix_cache_publishes_all_blocks_cleared(llm_and_sub):
    llm, sub = llm_and_sub
    generate(llm, distinct_prompt(9))
    assert llm.engine.core.reset_prefix_cache() is True
    events = receive_until(sub, lambda e: isinstance(e, AllBlocksCleared))
    assert isinstance(events[-1], AllBlocksCleared)
    assert llm.scheduler.kv_cache_manager.block_pool.cached_blocks == {}
