"""ShmBuffers has client/cpp EngineBuffers' layout and cleans up after itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from eps_client import BufferLayout, BufferShape, ModelLayout, ShmBuffers, SummaryFeatures
from eps_client.buffers import ALIGNMENT, CONTRACT, REGION_ALIGNMENT
from eps_client.layout import SUMMARY_LAYOUT
from eps_client.proto import page_selector_pb2 as pb


def cpp_descriptors(tool: str, model: ModelLayout, shape: BufferShape) -> pb.SharedBuffers:
    f = model.features
    args = [model.num_layers, model.num_q_heads, model.num_kv_heads, model.head_dim,
            model.block_size, model.group_blocks, model.sketch_dim, int(f.key_sum),
            int(f.quest), int(f.principal), int(f.quest8), shape.num_slots, shape.max_seqs,
            shape.max_context, shape.max_batch, int(shape.per_kv_head)]
    if model.has_coarse_level or shape.with_feedback:
        args += [model.coarse_blocks, shape.coarse_slots]
    if shape.with_feedback:
        args += [1]
    out = subprocess.run([tool, "descriptors", *map(str, args)], check=True,
                         capture_output=True).stdout
    return pb.SharedBuffers.FromString(out)


def without_names(buffers: pb.SharedBuffers) -> pb.SharedBuffers:
    copy = pb.SharedBuffers()
    copy.CopyFrom(buffers)
    for field in copy.DESCRIPTOR.fields:
        getattr(copy, field.name).host_shm.name = ""
    return copy


def test_contract_table_equals_core_buffer_contract(core_reference):
    cpp = json.loads(subprocess.run([core_reference, "contract"], check=True,
                                    capture_output=True, text=True).stdout)
    assert cpp["alignment"] == ALIGNMENT
    assert cpp["region_alignment"] == REGION_ALIGNMENT
    assert cpp["summary_layout"] == SUMMARY_LAYOUT
    ours = [{"name": spec.name, "dims": list(spec.dims), "dtype": np.dtype(spec.dtype).name,
             "output": spec.output, "optional": spec.optional,
             "coarse_level": spec.coarse_level} for spec in CONTRACT]
    assert ours == cpp["buffers"]


@pytest.mark.parametrize("per_kv_head", [False, True])
@pytest.mark.parametrize("features", [SummaryFeatures(quest=False),
                                      SummaryFeatures(quest=True, principal=True),
                                      SummaryFeatures(quest=True, principal=True, quest8=True)])
def test_descriptors_equal_the_cpp_engine_buffers(core_reference, per_kv_head, features):
    model = ModelLayout(num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=68, block_size=16,
                        group_blocks=4, sketch_dim=6, features=features)
    shape = BufferShape(num_slots=37, max_seqs=5, max_context=1000, max_batch=3,
                        per_kv_head=per_kv_head)
    with ShmBuffers(model, shape) as buf:
        ours = buf.descriptors()
        assert ours.summary_pool.host_shm.name == buf.shm_name
    assert without_names(ours) == without_names(cpp_descriptors(core_reference, model, shape))


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_coarse_descriptors_equal_the_cpp_engine_buffers(core_reference, per_kv_head):
    model = ModelLayout(num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=68, block_size=16,
                        group_blocks=4, sketch_dim=6, coarse_blocks=12)
    shape = BufferShape(num_slots=37, max_seqs=5, max_context=1000, max_batch=3,
                        per_kv_head=per_kv_head, coarse_slots=11)
    with ShmBuffers(model, shape) as buf:
        ours = buf.descriptors()
        assert buf.max_coarse_groups == 6  # 63 blocks, 12 a coarse group
        assert buf.coarse_pool is not None and buf.coarse_pool.shape == (
            11, 3, 3, buf.layout.record_words)
        assert buf.coarse_table is not None and buf.coarse_table.shape == (5, 6)
        # after flags: the buffers before them keep their offsets
        flat = BufferLayout.compute(ModelLayout(**{**model.__dict__, "coarse_blocks": 0}),
                                    BufferShape(37, 5, 1000, 3, per_kv_head=per_kv_head))
        for name, offset in flat.offsets.items():
            assert buf.layout.offsets[name] == offset, name
        assert buf.layout.offsets["coarse_pool"] > buf.layout.offsets["flags"]
    assert ours.HasField("coarse_pool") and ours.HasField("coarse_table")
    assert without_names(ours) == without_names(cpp_descriptors(core_reference, model, shape))


def test_without_a_coarse_level_there_are_no_coarse_buffers():
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
    with ShmBuffers(model, BufferShape(4, 2, 256, 2)) as buf:
        assert buf.coarse_pool is None and buf.coarse_table is None
        message = buf.descriptors()
        assert not message.HasField("coarse_pool") and not message.HasField("coarse_table")
        assert "coarse_pool" not in buf.layout.offsets


@pytest.mark.parametrize("coarse_blocks", [0, 12])
def test_feedback_descriptors_equal_the_cpp_engine_buffers(core_reference, coarse_blocks):
    model = ModelLayout(num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=68, block_size=16,
                        group_blocks=4, sketch_dim=6, coarse_blocks=coarse_blocks)
    plain = BufferShape(num_slots=37, max_seqs=5, max_context=1000, max_batch=3,
                        coarse_slots=11 if coarse_blocks else 0)
    shape = BufferShape(**{**plain.__dict__, "with_feedback": True})
    with ShmBuffers(model, shape) as buf:
        ours = buf.descriptors()
        assert buf.feedback is not None and buf.feedback.shape == (3, 5, 6, buf.max_groups)
        assert buf.feedback.dtype == np.float32 and np.isnan(buf.feedback).all()
        # last: every other buffer keeps its offset
        without = BufferLayout.compute(model, plain)
        for name, offset in without.offsets.items():
            assert buf.layout.offsets[name] == offset, name
        assert buf.layout.offsets["feedback"] == without.size
    assert ours.HasField("feedback")
    assert list(ours.feedback.shape) == [3, 5, 6, 16]  # 63 blocks, 4 a group
    assert without_names(ours) == without_names(cpp_descriptors(core_reference, model, shape))


def test_without_with_feedback_there_is_no_feedback_buffer(core_reference):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
    shape = BufferShape(4, 2, 256, 2)
    assert not shape.with_feedback
    with ShmBuffers(model, shape) as buf:
        assert buf.feedback is None
        assert "feedback" not in buf.layout.offsets
        assert not buf.descriptors().HasField("feedback")
    assert not cpp_descriptors(core_reference, model, shape).HasField("feedback")


def test_coarse_slots_must_match_the_coarse_level():
    flat = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
    coarse = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8,
                         coarse_blocks=4)
    with pytest.raises(ValueError, match="coarse_slots=0 with coarse_blocks=4"):
        BufferLayout.compute(coarse, BufferShape(4, 2, 256, 2))
    with pytest.raises(ValueError, match="coarse_slots=3 with coarse_blocks=0"):
        BufferLayout.compute(flat, BufferShape(4, 2, 256, 2, coarse_slots=3))
    with pytest.raises(ValueError, match="coarse_slots=-1"):
        BufferShape(4, 2, 256, 2, coarse_slots=-1)


def test_views_alias_the_shared_object():
    model = ModelLayout(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=8)
    with ShmBuffers(model, BufferShape(4, 2, 256, 2)) as buf:
        buf.block_table[1, 3] = 77
        offset = buf.layout.offsets["block_table"] + (1 * buf.max_blocks + 3) * 4
        with open(f"/dev/shm{buf.shm_name}", "rb") as f:
            f.seek(offset)
            assert np.frombuffer(f.read(4), np.int32)[0] == 77


def test_close_unlinks_the_object_even_while_a_view_is_held():
    model = ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=4)
    buf = ShmBuffers(model, BufferShape(1, 1, 16, 1))
    held = buf.queries  # noqa: F841 - the engine may keep a view past close()
    path = f"/dev/shm{buf.shm_name}"
    assert os.path.exists(path)
    buf.close()
    assert not os.path.exists(path)
    buf.close()  # idempotent


def test_bad_shape_is_rejected():
    with pytest.raises(ValueError, match="max_batch=0"):
        BufferShape(num_slots=1, max_seqs=1, max_context=1, max_batch=0)


MODEL_ARGS = {"num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def test_numpy_integers_make_the_same_model_as_ints():
    model = ModelLayout(**{k: np.int64(v) for k, v in MODEL_ARGS.items()},
                        phi_seed=np.uint64(2**64 - 1), coarse_blocks=np.int32(4))
    assert model == ModelLayout(**MODEL_ARGS, phi_seed=2**64 - 1, coarse_blocks=4)
    assert type(model.num_layers) is int and type(model.phi_seed) is int
    assert model.to_proto().num_layers == 2


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"num_layers": 2.0}, TypeError, "num_layers=2.0 is not an integer"),
    ({"num_kv_heads": True}, TypeError, "num_kv_heads=True is a bool"),
    ({"num_layers": 0}, ValueError, "num_layers=0 not in [1, 4096]"),
    ({"phi_seed": 1.5}, TypeError, "phi_seed=1.5 is not an integer"),
    ({"phi_seed": None}, TypeError, "phi_seed=None is not an integer"),
    ({"phi_seed": -1}, ValueError, "phi_seed=-1 is not a 64-bit unsigned integer"),
    ({"kv_dtype": 99}, ValueError, "kv_dtype=99 is not one of"),
    ({"kv_dtype": None}, TypeError, "kv_dtype=None is not an integer"),
    ({"kv_dtype": np.float16}, TypeError, "is not an integer"),
    ({"features": None}, TypeError, "features=None is not a SummaryFeatures"),
    ({"coarse_blocks": 4.0}, TypeError, "coarse_blocks=4.0 is not an integer"),
])
def test_a_bad_model_field_is_refused_naming_it(fields, error, message):
    with pytest.raises(error) as e:
        ModelLayout(**{**MODEL_ARGS, **fields})
    assert message in str(e.value)


def test_a_kv_dtype_given_as_its_proto_value_is_kept():
    assert ModelLayout(**MODEL_ARGS, kv_dtype=pb.DTYPE_BFLOAT16).kv_dtype == pb.DTYPE_BFLOAT16
    with pytest.raises(TypeError, match="SummaryFeatures.quest='yes' is not a bool"):
        SummaryFeatures(quest="yes")  # type: ignore[arg-type]


def test_every_kv_dtype_epsd_accepts_is_accepted():
    # docs/api.md: FLOAT16, BFLOAT16, FLOAT32 or INT8 (an int8 cache was refused here).
    for name, value in (("float16", pb.DTYPE_FLOAT16), ("bfloat16", pb.DTYPE_BFLOAT16),
                        ("float32", pb.DTYPE_FLOAT32), ("int8", pb.DTYPE_INT8)):
        assert ModelLayout(**MODEL_ARGS, kv_dtype=name).kv_dtype == value
        assert ModelLayout(**MODEL_ARGS, kv_dtype=value).to_proto().kv_dtype == value


def own_shm_objects() -> list[str]:
    """This process's objects in /dev/shm: ShmBuffers names them eps-<tag>-<pid>-<n>. Only
    those: tests running side by side (ctest -j) create and unlink objects of their own."""
    own = re.compile(rf"eps-.*-{os.getpid()}-\d+")
    return sorted(name for name in os.listdir("/dev/shm") if own.fullmatch(name))


def test_own_shm_objects_lists_the_objects_of_shm_buffers():
    with ShmBuffers(ModelLayout(**MODEL_ARGS), BufferShape(4, 2, 256, 2), tag="x-y") as buf:
        assert buf.shm_name[1:] in own_shm_objects()
    assert buf.shm_name[1:] not in own_shm_objects()


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"num_slots": 1.5}, TypeError, "BufferShape.num_slots=1.5 is not an integer"),
    ({"max_context": 100.5}, TypeError, "BufferShape.max_context=100.5 is not an integer"),
    ({"max_batch": None}, TypeError, "BufferShape.max_batch=None is not an integer"),
    ({"max_seqs": True}, TypeError, "BufferShape.max_seqs=True is a bool"),
    ({"coarse_slots": 1.0}, TypeError, "BufferShape.coarse_slots=1.0 is not an integer"),
    ({"per_kv_head": 1}, TypeError, "BufferShape.per_kv_head=1 is not a bool"),
])
def test_a_bad_buffer_shape_is_refused_before_any_shared_memory(fields, error, message):
    before = own_shm_objects()
    with pytest.raises(error) as e:
        BufferShape(**{"num_slots": 4, "max_seqs": 4, "max_context": 512, "max_batch": 4,
                       **fields})
    assert message in str(e.value)
    assert own_shm_objects() == before
    shape = BufferShape(np.int64(4), np.int32(2), np.uint16(256), np.int8(2))
    assert shape == BufferShape(4, 2, 256, 2) and type(shape.num_slots) is int


def test_visits_are_none_for_attend_densely_and_refuse_indices_out_of_range():
    model = ModelLayout(**MODEL_ARGS)
    with ShmBuffers(model, BufferShape(4, 2, 256, 3)) as buf:
        buf.visit_count[0, 0] = -1
        buf.visit_blocks[0, 0, :3] = [5, 6, 7]
        assert buf.visits(0, 0) is None
        buf.visit_count[0, 0] = 0
        visits = buf.visits(0, 0)
        assert visits is not None and visits.size == 0
        buf.visit_count[1, 2] = 2
        buf.visit_blocks[1, 2, :2] = [3, 9]
        assert buf.visits(np.int64(1), 2).tolist() == [3, 9]  # type: ignore[union-attr]
        for layer, pos, head in ((-1, 0, 0), (2, 0, 0), (0, -1, 0), (0, 3, 0), (0, 0, 1)):
            with pytest.raises(ValueError, match="not in"):
                buf.visits(layer, pos, head)
        with pytest.raises(TypeError, match="batch_pos=0.0 is not an integer"):
            buf.visits(0, 0.0)  # type: ignore[arg-type]


def test_closed_buffers_say_so():
    model = ModelLayout(**MODEL_ARGS)
    buf = ShmBuffers(model, BufferShape(4, 2, 256, 3))
    buf.close()
    for call in (lambda: buf.visits(0, 0), buf.selection_done, buf.descriptors):
        with pytest.raises(ValueError, match="buffers closed"):
            call()
    buf.close()  # twice is fine


def test_a_dev_shm_too_small_is_an_oserror_not_a_sigbus(tmp_path):
    # SharedMemory sizes its object with ftruncate, sparse on tmpfs: with /dev/shm too small
    # (a container's 64 MiB) the feedback buffer's NaN fill died of SIGBUS. Run in a mount
    # namespace of its own whose /dev/shm is a 1 MiB tmpfs (root only; skipped elsewhere).
    script = tmp_path / "small_shm.py"
    script.write_text(
        "import glob\n"
        "from eps_client import BufferShape, ModelLayout, ShmBuffers\n"
        "shape = BufferShape(num_slots=4000, max_seqs=3, max_context=1000, max_batch=2,\n"
        "                    with_feedback=True)\n"
        "try:\n"
        "    ShmBuffers(ModelLayout(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=32),\n"
        "               shape, tag='small')\n"
        "except OSError as e:\n"
        "    assert 'large enough' in str(e) and not glob.glob('/dev/shm/eps-small-*'), e\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    raise SystemExit('created')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no mount namespace here (not root?)")
    run = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount --make-rprivate / && "
         "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec \"$0\" \"$1\"", sys.executable,
         str(script)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    assert "refused:" in run.stdout and "No space left" in run.stdout


def test_a_name_a_dead_process_left_behind_is_left_alone_and_another_chosen():
    # A crashed engine restarted in its container often gets its pid back while /dev/shm
    # keeps the object it left: the name ShmBuffers would choose is taken (before, it raised
    # FileExistsError).
    from multiprocessing import shared_memory

    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
    shape = BufferShape(1, 1, 64, 1)
    with ShmBuffers(model, shape, tag="stale") as first:
        base, n = first.shm_name.lstrip("/").rsplit("-", 1)
    taken = f"{base}-{int(n) + 1}"
    stale = shared_memory.SharedMemory(name=taken, create=True, size=4096)
    try:
        with ShmBuffers(model, shape, tag="stale") as second:
            assert second.shm_name != "/" + taken
            assert second.shm_name.startswith(f"/{taken}-")
        kept = shared_memory.SharedMemory(name=taken)
        assert kept.size >= 4096
        kept.close()
    finally:
        stale.close()
        stale.unlink()


# Stale objects (docs/api-memory.md §3.3): ShmBuffers removes the objects of its tag that a
# dead process left, and nothing else. Each test's tag has this process's pid in it, so
# that tests running side by side never see each other's objects.

REAP_MODEL = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
REAP_SHAPE = BufferShape(1, 1, 64, 1)

# A creator that lives, holding its buffers, until killed (-9, as a crashed engine dies:
# nothing of its own runs). Its multiprocessing resource tracker would outlive it and unlink
# what it registered, hiding what is tested; in a crashed container the tracker dies with
# the engine, so the child registers nothing with one.
CREATOR = """
import sys
from multiprocessing import resource_tracker
resource_tracker.register = lambda name, rtype: None
from eps_client import BufferShape, ModelLayout, ShmBuffers
model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
held = [ShmBuffers(model, BufferShape(1, 1, 64, 1), tag=sys.argv[1])
        for _ in range(int(sys.argv[2]))]
print(" ".join(b.shm_name for b in held), flush=True)
sys.stdin.read()
"""


class Creator:
    def __init__(self, tag: str, count: int) -> None:
        import eps_client

        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(eps_client.__file__))}
        self.process = subprocess.Popen([sys.executable, "-c", CREATOR, tag, str(count)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env)
        assert self.process.stdout is not None
        self.names = self.process.stdout.readline().split()
        assert len(self.names) == count, "the child could not create its buffers"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def creator():
    made: list[Creator] = []

    def make(tag: str, count: int) -> Creator:
        made.append(Creator(tag, count))
        return made[-1]

    yield make
    for c in made:
        c.kill()
        for name in c.names:
            if os.path.exists(f"/dev/shm{name}"):
                os.unlink(f"/dev/shm{name}")


def make_unheld(name: str) -> None:
    """An object no one holds, as one is between its creation and its creator's lock."""
    fd = os.open(f"/dev/shm{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)


def exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm{name}")


def test_the_objects_of_a_killed_creator_are_removed_by_the_next_shm_buffers(creator):
    tag = f"killed{os.getpid()}"
    child = creator(tag, 2)
    child.kill()
    assert all(exists(name) for name in child.names)
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0) as buf:
        assert [name for name in child.names if exists(name)] == []
        assert exists(buf.shm_name)


def test_the_object_of_a_live_creator_is_kept(creator):
    from eps_client._stale_shm import reap_stale

    tag = f"live{os.getpid()}"
    child = creator(tag, 1)
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
        assert exists(child.names[0])
        assert reap_stale(tag, 0) == [], "this process's own object was taken"
        # Only the lock kept it: once its creator is gone, it goes.
        child.kill()
        assert reap_stale(tag, 0) == child.names


def test_an_unheld_object_younger_than_the_grace_period_is_kept():
    from eps_client._stale_shm import reap_stale

    tag = f"young{os.getpid()}"
    young = f"/eps-{tag}-1-0"
    make_unheld(young)
    try:
        with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag):  # STALE_SHM_GRACE_S
            assert exists(young)
        # Only its age kept it.
        assert reap_stale(tag, 0) == [young]
    finally:
        if exists(young):
            os.unlink(f"/dev/shm{young}")


@pytest.mark.parametrize("grace", [-1, -0.5, float("nan"), float("inf"), float("-inf")])
def test_a_negative_or_non_finite_grace_period_is_refused_before_anything_is_removed(grace):
    # A negative one would take an object whose creator has not locked it yet (as young as
    # one can be); NaN and infinity would quietly take none. Refused before the reaping and
    # the creation: the young unheld object stays, and no object is made.
    from eps_client._stale_shm import reap_stale

    tag = f"grace{os.getpid()}"
    young = f"/eps-{tag}-1-0"
    make_unheld(young)
    try:
        with pytest.raises(ValueError, match=re.escape(f"stale_grace_s={float(grace)!r}")):
            ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=grace)
        with pytest.raises(ValueError, match=re.escape(f"grace_s={float(grace)!r}")):
            reap_stale(tag, grace)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"eps-{tag}-")] == [young[1:]]
    finally:
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"eps-{tag}-"):
                os.unlink(f"/dev/shm/{name}")


def test_only_the_names_shm_buffers_makes_for_the_tag_are_removed():
    tag = f"names{os.getpid()}"
    prefix = f"/eps-{tag}-"
    reaped = [prefix + "1-0", prefix + "4194304-17",
              prefix + "1-1-abc",  # EngineBuffers' suffix (absl::Hex, no padding)
              prefix + "1-2-0123456789abcdef"]  # ShmBuffers' suffix (16 digits)
    kept = [f"/eps-{tag}x-1-0", f"/eps-x{tag}-1-0", f"/eps-{tag}-other-1-0",
            f"/epsx-{tag}-1-0", f"/x-eps-{tag}-1-0", prefix + "1", prefix + "1-",
            prefix + "-1-0", prefix + "1-0-", prefix + "1-0-0-0", prefix + "1-0-ABC",
            prefix + "1-0-xyz", prefix + "1-0-0123456789abcdef0", prefix + "1-0.lock",
            prefix + "+1-0", prefix + "١-0"]  # an Arabic-Indic digit: not \d in C++
    for name in reaped + kept:
        make_unheld(name)
    try:
        with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
            assert [name for name in reaped if exists(name)] == []
            assert [name for name in kept if not exists(name)] == []
    finally:
        for name in reaped + kept:
            if exists(name):
                os.unlink(f"/dev/shm{name}")



def test_a_fifo_or_symlink_under_the_tags_names_is_left_alone():
    # Entries under the tag's names that are no objects: a FIFO (an open that waited on it
    # would hang ShmBuffers) and a symlink to an unheld object of the same user (the link is
    # not the object; neither is followed). Both stay, and ShmBuffers returns.
    tag = f"special{os.getpid()}"
    fifo, link, target = f"/eps-{tag}-1-0", f"/eps-{tag}-1-1", f"/eps-{tag}x-1-0"
    os.mkfifo(f"/dev/shm{fifo}", 0o600)
    make_unheld(target)
    os.symlink(f"/dev/shm{target}", f"/dev/shm{link}")
    try:
        with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
            assert os.path.lexists(f"/dev/shm{fifo}") and os.path.lexists(f"/dev/shm{link}")
            assert exists(target)
    finally:
        for name in (fifo, link, target):
            if os.path.lexists(f"/dev/shm{name}"):
                os.unlink(f"/dev/shm{name}")

def test_what_is_no_regular_file_under_the_tags_names_is_not_even_opened():
    # Checked before it is opened: opening a FIFO wakes a writer waiting on it (a device
    # would do more). inotify reports every open of the FIFO, here none.
    import ctypes

    from eps_client._stale_shm import reap_stale

    in_open, in_dont_follow = 0x20, 0x02000000  # <sys/inotify.h>
    libc = ctypes.CDLL(None, use_errno=True)
    tag = f"unopened{os.getpid()}"
    fifo = f"/dev/shm/eps-{tag}-1-0"
    os.mkfifo(fifo, 0o600)
    watch = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert watch >= 0, os.strerror(ctypes.get_errno())
    try:
        assert libc.inotify_add_watch(watch, fifo.encode(), in_open | in_dont_follow) >= 0, \
            os.strerror(ctypes.get_errno())
        assert reap_stale(tag, 0) == []
        with pytest.raises(BlockingIOError):  # no event: the reaper did not open it
            os.read(watch, 4096)
    finally:
        os.close(watch)
        os.unlink(fifo)


def test_an_entry_replaced_between_its_check_and_its_open_is_left_alone(monkeypatch):
    # The name can come to name something else after the reaper checked it (here a FIFO
    # renamed over an unheld object just before the open): only the inode checked is taken.
    # The reaper's clock is an hour ahead, so that the FIFO's fresh ctime (the rename's) does
    # not keep it as young: only the inode check may.
    import stat
    import time

    from eps_client._stale_shm import reap_stale

    tag = f"swapped{os.getpid()}"
    name, fifo = f"eps-{tag}-1-0", f"/dev/shm/{tag}-fifo"
    make_unheld("/" + name)
    os.mkfifo(fifo, 0o600)
    real_open = os.open

    def open_after_swap(path, flags, mode=0o777, *, dir_fd=None):
        if path == name and os.path.lexists(fifo):
            os.rename(fifo, f"/dev/shm/{name}")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_after_swap)
    monkeypatch.setattr(time, "time_ns", lambda real=time.time_ns: real() + 3600 * 10**9)
    try:
        assert reap_stale(tag, 0) == []
        assert stat.S_ISFIFO(os.lstat(f"/dev/shm/{name}").st_mode)
    finally:
        monkeypatch.undo()
        for path in (f"/dev/shm/{name}", fifo):
            if os.path.lexists(path):
                os.unlink(path)


def test_another_users_object_is_kept(creator, monkeypatch):
    # As another user: this process's uid is not the one the reaper takes for its own.
    tag = f"user{os.getpid()}"
    child = creator(tag, 1)
    child.kill()
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
        assert exists(child.names[0])
    monkeypatch.undo()
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
        assert not exists(child.names[0])



def test_a_forked_childs_close_leaves_its_parents_object_named_and_held():
    # A forked child has a copy of the parent's ShmBuffers (and of its lock's descriptor).
    # Its close(), or its garbage collection when it ends, must not remove the live
    # parent's object: epsd opens it again by name when the engine re-attaches.
    from eps_client._stale_shm import reap_stale

    tag = f"fork{os.getpid()}"
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0) as buf:
        pid = os.fork()
        if pid == 0:  # the child: close its copy, then end without running anything else
            try:
                buf.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert exists(buf.shm_name), "the child removed its parent's object"
        assert reap_stale(tag, 0) == [], "the parent's lock went with the child's copy"
    assert not exists(buf.shm_name)


def test_shm_buffers_cannot_be_pickled():
    # A copy in another process (multiprocessing's spawn and forkserver pickle a Process's
    # arguments) would hold copies of the arrays, not views of the object, and the lock's
    # descriptor number of this process; its close() would remove this process's object.
    import copy
    import pickle

    tag = f"pickle{os.getpid()}"
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag) as buf:
        with pytest.raises(TypeError, match=re.escape(buf.shm_name)):
            pickle.dumps(buf)
        with pytest.raises(TypeError, match=re.escape(buf.shm_name)):
            copy.copy(buf)
        assert exists(buf.shm_name)


def test_close_after_the_name_went_releases_the_object_quietly():
    # Someone removed the name (an operator's rm, an old client's reaper): close() still
    # unmaps and unlocks, and does not raise for a name that is already gone.
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=f"gone{os.getpid()}") as buf:
        os.unlink(f"/dev/shm{buf.shm_name}")
        buf.close()
        assert buf._lock_fd == -1 and buf._shm is None


# A process whose buffers' name someone removes (an operator's rm, an old client's reaper)
# before it closes them and ends.
CLOSE_AFTER_RM = """
import os
import sys
from eps_client import BufferShape, ModelLayout, ShmBuffers
model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
buf = ShmBuffers(model, BufferShape(1, 1, 64, 1), tag=sys.argv[1])
os.unlink("/dev/shm" + buf.shm_name)
buf.close()
"""


def test_close_after_the_name_went_leaves_the_resource_tracker_nothing_to_clean_up():
    # SharedMemory registers the object with multiprocessing's resource tracker, and only
    # its unlink() of a name still there unregisters it. A name left registered has the
    # tracker warn of a leak when the process ends and unlink the name itself: by then
    # maybe another process's object.
    import eps_client

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(eps_client.__file__))}
    ended = subprocess.run([sys.executable, "-c", CLOSE_AFTER_RM, f"rm{os.getpid()}"],
                           capture_output=True, text=True, env=env)
    assert ended.returncode == 0, ended.stderr
    assert "resource_tracker" not in ended.stderr, ended.stderr


def test_without_flock_shm_buffers_raise_and_leave_no_object(monkeypatch):
    # A /dev/shm whose flock fails (ENOLCK): an unheld object would be taken for a dead
    # engine's, so none is made (docs/api-memory.md §3.3).
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    tag = f"nolock{os.getpid()}"
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OSError, match="cannot lock") as raised:
        ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag)
    assert raised.value.errno == errno.ENOLCK
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"eps-{tag}-")] == []

def test_the_grace_period_is_the_cpp_clients():
    from eps_client._stale_shm import STALE_SHM_GRACE_S

    header = os.path.join(os.path.dirname(__file__), "..", "..", "cpp", "engine_buffers.h")
    with open(header) as f:
        cpp = re.search(r"kStaleShmGrace\{(\d+)\}", f.read())
    assert cpp is not None and float(cpp.group(1)) == STALE_SHM_GRACE_S
