"""Tuned configurations (``moe_fp8.kernels.tuning``, ``moe-fp8 tune``): keys, the table file, how ``get_config``
consults it, what is timed; on a Hopper GPU, a real tuning run whose table then drives correct launches."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from test_cli_warmup import DEEPSEEK_V3

from moe_fp8 import warmup as W
from moe_fp8.cli import main
from moe_fp8.kernels import tuning
from moe_fp8.kernels.gemm import generate_source, kernel_variant
from moe_fp8.kernels.heuristics import (
    TWO_WG_STAGES,
    GemmDesc,
    default_config,
    get_config,
    make_config,
    tuning_candidates,
)
from moe_fp8.utils import align

NORMAL = GemmDesc(768, 7168, 2048)
MASKED = GemmDesc(256, 4096, 7168, 32, "masked", expected_m=8)
CONTIGUOUS = GemmDesc(1024, 4096, 7168, 8, "contiguous")


@pytest.fixture
def table_env(tmp_path, monkeypatch):
    """A table file named by $MOE_FP8_TUNED_CONFIGS (written by the test), and a clean slate before and after."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tuning.ENV_TABLE, str(path))
    tuning.reset()
    yield path
    monkeypatch.setenv(tuning.ENV_TABLE, "off")
    tuning.reset()


def _result(desc: GemmDesc, config=None, us: float = 9.0) -> tuning.TuneResult:
    key = tuning.tuning_key(desc)
    default = default_config(key)
    return tuning.TuneResult(key, config or default, default, us, 10.0, 3)


# tables the tests write belong to the visible GPU (one of another device is ignored): an H100's without one
DEVICE = torch.cuda.get_device_name() if torch.cuda.is_available() else "NVIDIA H100 80GB HBM3"


def _table(*results: tuning.TuneResult) -> tuning.TunedTable:
    table = tuning.TunedTable(DEVICE, 132, kernels="", version="test")
    table.update(results)
    return table


def test_keys_round_rows_as_the_choice_does():
    key = tuning.tuning_key
    assert key(GemmDesc(705, 7168, 2048)) == key(GemmDesc(768, 7168, 2048)) == GemmDesc(768, 7168, 2048)
    assert key(GemmDesc(769, 7168, 2048)).m == 832
    # masked: the expected rows alone (max_m never changes the choice), in 16s at decode sizes, 64s above
    assert key(dataclasses.replace(MASKED, m=4096)) == key(MASKED) == dataclasses.replace(MASKED, m=16, expected_m=16)
    assert key(dataclasses.replace(MASKED, expected_m=17)).expected_m == 32
    assert key(dataclasses.replace(MASKED, expected_m=200)).expected_m == 256
    for desc in (NORMAL, MASKED, CONTIGUOUS, GemmDesc(100_000, 4096, 7168, 8, "contiguous"),
                 GemmDesc(300, 4096, 7168, 8, "contiguous", expected_m=40)):
        assert key(key(desc)) == key(desc)
        # every row count under one key gets the key's configuration from the model: an entry is safe to share
        assert default_config(key(desc)) == default_config(desc) or desc.layout == "masked"


def test_candidates_start_with_the_default_and_all_compile_to_valid_sources():
    for desc in (NORMAL, MASKED, CONTIGUOUS, GemmDesc(64, 2112, 7168),
                 GemmDesc(2048, 4096, 7168, 32, "contiguous", act_quant=1)):
        key = tuning.tuning_key(desc)
        cands = tuning_candidates(key, limit=6)
        assert cands[0] == default_config(key)
        assert len(set(cands)) == len(cands) > 1
        for cfg in cands:
            generate_source(key.layout, key.n, key.k, cfg, key.act_quant)
    # the model's known miss (docs/kernels/gemm.md, session 47): 128x128 at 4 stages is among what is timed
    tiles = {(c.block_m, c.block_n, c.num_stages) for c in tuning_candidates(NORMAL)}
    assert (128, 128, TWO_WG_STAGES) in tiles and (128, 192, TWO_WG_STAGES) in tiles


def test_table_round_trip_and_lookup(tmp_path):
    faster = make_config(128, 128, 132, k=2048, num_stages=4)
    table = _table(_result(NORMAL, faster, 8.0), _result(MASKED), _result(CONTIGUOUS))
    path = tmp_path / "sub" / "t.json"
    table.save(path)
    loaded = tuning.TunedTable.load(path)
    assert loaded == table
    assert loaded.get(GemmDesc(705, 7168, 2048)) == faster
    assert loaded.get(MASKED) is None  # the default was kept: the model decides
    assert loaded.get(GemmDesc(768, 7168, 4096)) is None  # no entry
    assert math.isclose(loaded.results[tuning.tuning_key(NORMAL)].gain, 0.25)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format=99), "not a moe_fp8 tuned table"),
    (lambda d: d.pop("device"), "needs 'device'"),
    (lambda d: d["results"][0]["key"].update(m=700), "is not a tuning key"),
    (lambda d: d["results"][0]["key"].update(num_sms=114), "num_sms 114 in a table of 132"),
    (lambda d: d["results"][0]["config"].update(block_n=100), "unsupported block shape 128x100"),
    (lambda d: d["results"][0]["config"].update(k_split=True, tail_split=True), "tail halves need"),
    (lambda d: d["results"][0]["config"].pop("num_stages"), "exactly the fields"),
    (lambda d: d["results"][0].pop("us"), "needs the times"),
])
def test_a_bad_table_is_refused_naming_the_entry(tmp_path, edit, message):
    data = _table(_result(NORMAL, make_config(128, 128, 132, k=2048, num_stages=4))).to_json()
    edit(data)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(tuning.TunedTableError, match=message):
        tuning.TunedTable.load(path)


def test_get_config_follows_the_table_named_by_the_environment(table_env, monkeypatch):
    faster = make_config(128, 112, 132, k=2048, num_stages=4)  # a tile no row count of this GEMM picks otherwise
    _table().save(table_env)
    assert get_config(NORMAL) == default_config(NORMAL) != faster
    _table(_result(NORMAL, faster)).save(table_env)
    tuning.reset()
    assert get_config(NORMAL) == get_config(GemmDesc(705, 7168, 2048)) == faster
    assert get_config(GemmDesc(640, 7168, 2048)) == default_config(GemmDesc(640, 7168, 2048))
    # warmup precompiles what the launches will pick, so the tuned variant too
    variants = W.enumerate_variants([W.GemmShape("o_proj", 7168, 2048)], 1024, 132)
    assert any(v.config == faster and v.rows == (705, 768) for v in variants)
    monkeypatch.setenv(tuning.ENV_TABLE, "off")
    tuning.reset()
    assert get_config(NORMAL) == default_config(NORMAL)


def test_a_named_table_that_is_missing_or_broken_fails_the_first_gemm(table_env):
    with pytest.raises(tuning.TunedTableError, match="no such file"):
        get_config(NORMAL)
    table_env.write_text("{")
    tuning.reset()
    with pytest.raises(tuning.TunedTableError, match="cannot read a JSON table"):
        get_config(NORMAL)


def test_a_table_of_another_device_is_ignored(table_env, monkeypatch):
    _table(_result(NORMAL, make_config(128, 128, 132, k=2048, num_stages=4))).save(table_env)
    monkeypatch.setattr(tuning, "_current_device_name", lambda: "NVIDIA H20")
    tuning.reset()
    with pytest.warns(UserWarning, match=f"measured on {DEVICE}, this is NVIDIA H20: not used"):
        assert get_config(NORMAL) == default_config(NORMAL)


def test_the_default_table_is_this_gpus_file_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "PACKAGED_DIR", tmp_path / "none shipped")
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(tuning.ENV_TABLE)
    monkeypatch.setattr(tuning, "_current_device_name", lambda: DEVICE)
    assert tuning.default_path("NVIDIA H100 80GB HBM3") == tmp_path / "tuned" / "nvidia-h100-80gb-hbm3.json"
    path = tuning.default_path(DEVICE)
    try:
        tuning.reset()
        assert tuning.active_table() is None  # none written yet
        faster = make_config(128, 128, 132, k=2048, num_stages=4)
        _table(_result(NORMAL, faster)).save(path)
        tuning.reset()
        assert get_config(NORMAL) == faster
    finally:
        monkeypatch.setenv(tuning.ENV_TABLE, "off")
        tuning.reset()


def test_contiguous_runs_fill_their_rows_as_segments():
    for key in (GemmDesc(1024, 4096, 7168, 8, "contiguous"), GemmDesc(384, 4096, 7168, 8, "contiguous"),
                GemmDesc(640, 4096, 7168, 8, "contiguous", expected_m=64),
                GemmDesc(8192 + 1024, 512, 7168, 32, "contiguous")):
        sizes = tuning._contiguous_sizes(key)
        assert len(sizes) == key.num_groups
        assert sum(align(s, 128) for s in sizes) == align(key.m, 128)
        if key.expected_m:
            assert max(sizes) <= 64
    with pytest.raises(ValueError, match="one block each"):
        tuning._contiguous_sizes(GemmDesc(2048, 4096, 7168, 8, "contiguous", expected_m=64))


def test_model_descs_add_decode_keys_and_drop_impossible_hints():
    gemms = W.model_gemms(DEEPSEEK_V3, ep=8)
    descs = tuning.model_descs(gemms, 512, 8, 132)
    masked = sorted({d.expected_m for d in descs if d.layout == "masked"})
    assert masked[:4] == [16, 32, 48, 64]
    assert all(d.m <= 128 * d.num_groups for d in descs if d.layout == "contiguous" and d.expected_m)
    assert {d.layout for d in tuning.model_descs(gemms, 512, 8, 132, ("normal",))} == {"normal"}
    keys = tuning.plan(descs)
    assert all(cands[0] == default_config(k) and len(cands) > 1 for k, cands in keys.items())
    # the fused GEMM1 at decode sizes has one tile to offer: nothing to time
    decode_w13 = [d for d in descs if d.layout == "masked" and d.act_quant and d.expected_m == 16]
    assert decode_w13 and len(tuning_candidates(decode_w13[0])) == 1
    assert tuning.tuning_key(decode_w13[0]) not in keys


def test_cli_dry_run_lists_keys_without_a_gpu(capsys):
    assert main(["tune", "--shape", "normal:768:7168:2048", "--shape", "masked:32:8:4096:7168", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 GEMM keys" in out
    assert "normal     M    768          7168x2048" in out and "default 128x192 s4" in out
    assert "masked     expected    16  32g 4096x7168" in out


@pytest.mark.parametrize("argv, message", [
    (["tune"], "nothing to tune"),
    (["tune", "--shape", "normal:1:2", "--dry-run"], "expected one of normal:M:N:K"),
    (["tune", "--shape", "masked:1:2:0:8", "--dry-run"], "positive integers"),
    (["tune", "--shape", "normal:64:256:256", "--min-gain", "1.5"], "--min-gain must be in"),
])
def test_cli_refuses_bad_arguments(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    assert code != 0
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_cli_without_a_gpu_says_so(capsys):
    assert main(["tune", "--shape", "normal:64:256:256", "--no-progress"]) == 1
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_bad_tuning_arguments_are_refused_before_any_launch():
    with pytest.raises(ValueError, match="limit must be >= 1"):
        tuning_candidates(NORMAL, limit=0)
    with pytest.raises(ValueError, match="reps >= 1"):
        tuning.time_configs(lambda cfg: None, [default_config(NORMAL)], reps=0)
    with pytest.raises(ValueError, match="needs configs"):
        tuning.time_configs(lambda cfg: None, [], reps=3)
    with pytest.raises(ValueError, match="0 <= min_gain < 1"):
        tuning.tune([NORMAL], min_gain=-0.5)
    with pytest.raises(ValueError, match="reps >= 1"):
        tuning.tune([NORMAL], reps=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what tuning says without a GPU")
def test_tuning_without_a_gpu_says_so():
    with pytest.raises(tuning.TuneError, match="needs a CUDA GPU"):
        tuning.tune([NORMAL])
    with pytest.raises(tuning.TuneError, match="none is visible"):
        tuning.new_table()


@pytest.mark.hopper
@pytest.mark.gpu
def test_tuning_on_the_gpu_writes_a_table_whose_picks_run_correctly(table_env):
    """A short real run (two candidates each, a few reps, any confirmed gain kept): the table it writes loads, and the
    GEMMs launched under it pick its configurations and match the reference."""
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_gemm_inputs, make_masked_inputs
    from moe_fp8.utils import calc_diff

    descs = [GemmDesc(200, 2112, 1024), GemmDesc(64, 1024, 1024, 4, "masked", expected_m=24)]
    results = tuning.tune(descs, limit=2, reps=3, min_gain=0.0)
    assert [r.key for r in results] == [tuning.tuning_key(d) for d in descs]
    assert all(r.us > 0 and r.default_us > 0 for r in results)
    table = tuning.new_table()
    table.update(results)
    table.save(table_env)
    tuning.reset()
    for r in results:
        assert get_config(r.key) == r.config
    inp = make_gemm_inputs(200, 2112, 1024, seed=1, device="cuda")
    out = moe_fp8.fp8_gemm(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale)
    assert calc_diff(out, ref.fp8_gemm(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale)) < 1e-5
    m = make_masked_inputs(4, 64, 24, 1024, 1024, seed=2, device="cuda")
    out = torch.full((4, 64, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_fp8.fp8_grouped_gemm_masked(m.x_fp8, m.x_scale, m.w_fp8, m.w_scale, m.masked_m, 24, out=out)
    expect = ref.fp8_grouped_gemm_masked(m.x_fp8, m.x_scale, m.w_fp8, m.w_scale, m.masked_m)
    for g, rows in enumerate(m.masked_m.tolist()):
        assert calc_diff(out[g, :rows], expect[g, :rows]) < 1e-5


def test_shipped_tables_load_and_differ_from_the_model():
    """Every table in the package loads (each entry rebuilt through make_config and checked against its layout),
    belongs to the device its file names, and holds only picks that beat the model's."""
    paths = sorted(tuning.PACKAGED_DIR.glob("*.json"))
    assert paths, "the package ships at least the H100's table"
    for path in paths:
        table = tuning.TunedTable.load(path)
        assert path.name == tuning.device_file_name(table.device)
        assert table.results and all(r.config != r.default and r.us < r.default_us for r in table.results.values())


def test_shipped_tables_were_measured_on_these_gemm_sources():
    """A table's ``kernels`` hashes the wgmma GEMM's include closure: every shipped table matches the sources here
    (a change to them needs the picks re-measured), and the kernels that share no header with it (the few-rows
    GEMM, the data path) are outside it."""
    from moe_fp8.kernels.jit.cache import include_closure_hash, include_tree_hash

    for path in sorted(tuning.PACKAGED_DIR.glob("*.json")):
        assert tuning.TunedTable.load(path).kernels == tuning._kernel_sources_hash(), path.name
    assert tuning._kernel_sources_hash() != include_tree_hash()
    assert include_closure_hash("moe_fp8/impls/fp8_gemm_few_rows.cuh") != include_closure_hash(tuning.GEMM_ENTRY_HEADER)


def test_the_shipped_table_is_overridden_entry_by_entry_by_this_machines_own(tmp_path, monkeypatch):
    name = DEVICE
    monkeypatch.setattr(tuning, "PACKAGED_DIR", tmp_path / "pkg")
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(tuning.ENV_TABLE)
    monkeypatch.setattr(tuning, "_current_device_name", lambda: name)
    shipped = {NORMAL: make_config(128, 128, 132, k=2048, num_stages=4),
               GemmDesc(1024, 7168, 2048): make_config(128, 128, 132, k=2048, num_stages=5)}
    own = {NORMAL: make_config(128, 112, 132, k=2048, num_stages=4)}
    _table(*(_result(d, c) for d, c in shipped.items())).save(tuning.packaged_path(name))
    _table(*(_result(d, c) for d, c in own.items())).save(tuning.default_path(name))
    try:
        tuning.reset()
        assert get_config(NORMAL) == own[NORMAL]
        assert get_config(GemmDesc(1024, 7168, 2048)) == shipped[GemmDesc(1024, 7168, 2048)]
        monkeypatch.setenv(tuning.ENV_TABLE, str(tuning.default_path(name)))  # a named table: that one alone
        tuning.reset()
        assert get_config(GemmDesc(1024, 7168, 2048)) == default_config(GemmDesc(1024, 7168, 2048))
    finally:
        monkeypatch.setenv(tuning.ENV_TABLE, "off")
        tuning.reset()


@pytest.mark.hopper
@pytest.mark.gpu
def test_every_shipped_pick_of_this_gpu_computes_the_reference():
    """Each distinct kernel the shipped table of this GPU can launch (layout, N, K, config) on a small ragged
    problem of its layout, checked as tests/test_gemm_hopper.py and test_grouped_hopper.py check the model's."""
    from test_gemm_hopper import _check
    from test_grouped_hopper import _check_act, _check_contiguous, _check_masked, _poisoned_act

    from moe_fp8.kernels import gemm
    from moe_fp8.kernels.gemm import kernel_variant
    from moe_fp8.testing import make_contiguous_inputs, make_gemm_inputs, make_masked_inputs

    path = tuning.packaged_path(torch.cuda.get_device_name())
    if not path.exists():
        pytest.skip(f"no table is shipped for {torch.cuda.get_device_name()}")
    variants = {(r.key.layout, r.key.n, r.key.k, r.key.act_quant, r.config): r.key
                for r in tuning.TunedTable.load(path).results.values()}
    W.compile_variants([W.Variant(*kernel_variant(key, cfg), key.layout, key.n, key.k, cfg)
                        for (*_, cfg), key in variants.items()])
    for layout, n, k, act_quant, cfg in variants:
        ue8m0 = act_quant == 2
        if layout == "normal":
            inp = make_gemm_inputs(200, n, k, seed=n + k, device="cuda")
            out = torch.full((200, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm.fp8_gemm_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, out, config=cfg)
            torch.cuda.synchronize()
            _check(out, inp, k)
        elif layout == "contiguous":
            inp = make_contiguous_inputs(3, 100, n, k, seed=n + k, device="cuda", num_empty=1)
            rows = inp.x_fp8.shape[0]
            if act_quant:
                act, scale = _poisoned_act((rows, n // 2))
                gemm.fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                            inp.m_indices, None, 0, ue8m0, act, scale, config=cfg)
                torch.cuda.synchronize()
                _check_act(inp, act, scale, inp.m_indices >= 0, ue8m0)
            else:
                out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemm.fp8_grouped_gemm_contiguous_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                        inp.m_indices, out, config=cfg)
                torch.cuda.synchronize()
                _check_contiguous(inp, out)
        else:
            inp = make_masked_inputs(3, 192, 100, n, k, seed=n + k, device="cuda", num_empty=1)
            if act_quant:
                act, scale = _poisoned_act((3, 192, n // 2), groups=3)
                gemm.fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, None,
                                                            inp.masked_m, 100, ue8m0, act, scale, config=cfg)
                torch.cuda.synchronize()
                valid = torch.arange(192, device="cuda")[None, :] < inp.masked_m[:, None]
                _check_act(inp, act, scale, valid, ue8m0, masked_m=inp.masked_m)
            else:
                out = torch.full((3, 192, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemm.fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m,
                                                    100, out, config=cfg)
                torch.cuda.synchronize()
                _check_masked(inp, out)


@pytest.mark.hopper
@pytest.mark.gpu
def test_cli_tunes_into_a_table_and_a_second_run_resumes(tmp_path, capsys, table_env):
    out = tmp_path / "t.json"
    argv = ["tune", "--shape", "normal:200:2112:1024", "--shape", "normal:64:2112:1024", "--limit", "2", "--reps", "3",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "tuned     2 keys" in first and f"export {tuning.ENV_TABLE}={out}" in first
    assert len(tuning.TunedTable.load(out).results) == 2
    assert main([*argv, "--shape", "normal:300:2112:1024"]) == 0
    second = capsys.readouterr().out
    assert "2 of them skipped" in second and "tuned     1 keys" in second
    assert len(tuning.TunedTable.load(out).results) == 3


def test_warmup_without_a_gpu_compiles_the_shipped_picks_too(monkeypatch):
    """On a CPU node the serving GPU is unknown: warmup adds every shipped table's picks of its SM count (unless
    $MOE_FP8_TUNED_CONFIGS names a table, which get_config then reads)."""
    gemms = W.model_gemms(DEEPSEEK_V3, tp=8)
    plain = {v.name for v in W.enumerate_variants(gemms, 2048, 132, tables=[])}
    monkeypatch.delenv(tuning.ENV_TABLE)
    monkeypatch.setattr(tuning, "_current_device_name", lambda: None)
    tables = tuning.warmup_tables(132)
    assert tuning.TunedTable.load(tuning.packaged_path("NVIDIA H100 80GB HBM3")) in tables
    assert len(tables) == len(list(tuning.PACKAGED_DIR.glob("*.json"))) and tuning.warmup_tables(114) == []
    with_picks = W.enumerate_variants(gemms, 2048, 132)
    names = {v.name for v in with_picks}
    assert plain < names
    for shipped in tables:
        for desc in tuning.model_descs(gemms, 2048, 8, 132):
            cfg = shipped.get(desc)
            if cfg is not None:
                assert kernel_variant(desc, cfg)[0] in names, (shipped.device, desc)


def test_warmup_enumerates_every_tuning_key_a_call_can_have():
    """Each row count a call can bring (M, expected M per expert, M_total) maps to the tuning key of one of warmup's
    descriptors, so warmup compiles whatever a table holds for it."""
    for g in (W.GemmShape("o_proj", 7168, 2048), W.GemmShape("w2", 7168, 2048, ("contiguous", "masked"), 32)):
        keys = {tuning.tuning_key(d) for _, _, _, d in W.shape_descs(g, 600, 8, 132)}
        for rows in range(1, 601):
            if "normal" in g.layouts:
                assert tuning.tuning_key(GemmDesc(rows, g.n, g.k)) in keys, rows
            if "masked" in g.layouts:
                assert tuning.tuning_key(GemmDesc(4096, g.n, g.k, 32, "masked", expected_m=rows)) in keys, rows
        for m_total in range(128, 600 * 8 + 128 * 32 + 1, 128) if "contiguous" in g.layouts else ():
            for hint in (None, 40):
                desc = GemmDesc(m_total, g.n, g.k, 32, "contiguous", expected_m=hint)
                assert tuning.tuning_key(desc) in keys, desc
