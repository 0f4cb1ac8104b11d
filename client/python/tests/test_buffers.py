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
