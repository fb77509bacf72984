"""tiresias.packing.profiles: the co-location throughput store, its loaders and the linear estimate."""
from __future__ import annotations

import json
import pathlib
import random

import pytest

from tiresias.packing.profiles import JobType, ProfileStore, load_profiles, parse_gavel_key

DATA = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "colocation"
BLOX = DATA / "blox_norm_speed.csv"
GAVEL = DATA / "gavel_simulation_throughputs.json"
needs_data = pytest.mark.skipif(not (BLOX.is_file() and GAVEL.is_file()), reason="co-location tables not present")

BERT2 = JobType("Bert-Large", "256/16", 2)
POINTNET2 = JobType("PointNet", "64", 2)


@pytest.fixture(scope="module")
def blox() -> ProfileStore:
    return load_profiles(BLOX)


@pytest.fixture(scope="module")
def gavel_raw() -> dict:
    with open(GAVEL) as f:
        return json.load(f)


def gavel_expected(raw: dict, gpu: str, a: str, b: str) -> tuple[float, float]:
    table = raw[gpu]
    own, other = table[a][b]
    return own / table[a]["null"], other / table[b]["null"]


def small_store() -> ProfileStore:
    a1, b1 = JobType("A", "8", 1), JobType("B", "8", 1)
    return ProfileStore({a1: None, b1: None}, {(a1, b1): (0.6, 0.8), (a1, a1): (0.0, 0.0)}, source="test")


# -- blox table -------------------------------------------------------------------------------


@needs_data
def test_blox_job_types(blox):
    types = blox.job_types()
    # 4 models x 3 batches x 3 GPU counts + Bert-Large/GPT2-Medium: 2 pipeline batches + 2 TP batches each
    assert len(types) == 44
    assert types == sorted(types)
    assert JobType("Bert-Large", "256/32", 2) in types  # tensor-parallel rows have their own batch string
    assert all(blox.isolated(t) is None for t in types)  # normalised table: no absolute speeds


@needs_data
def test_blox_best_strategy_and_symmetry(blox):
    # rows 40, 52, 64, 76, 88, 100, 112 (pipeline splits) and 622 (DP24); the best sum is row 64 ("6,18")
    assert blox.pair(BERT2, POINTNET2) == (0.37, 1.0)
    assert blox.pair(POINTNET2, BERT2) == (1.0, 0.37)
    assert not blox.estimated(BERT2, POINTNET2)
    # rows 42 ("8,16": 0.51 + 0.74) and 54 ("6,18": 0.46 + 0.79) tie at 1.25: the first row wins
    assert blox.pair(BERT2, JobType("resnet50", "32", 2)) == (0.51, 0.74)
    # rows 45, 57 and 81 tie at 1.15 (0.33+0.82, 0.3+0.85, 0.43+0.72): row 45
    assert blox.pair(BERT2, JobType("vgg19", "32", 2)) == (0.33, 0.82)
    # rows 118 (0.25+0.84), 130 (0.24+0.85) and 628 (DP24, 0.31+0.78) tie at 1.09, but as floats
    # the first two sum to 1.0899999999999999: sums are compared rounded, so row 118 wins
    assert blox.pair(BERT2.at(4), JobType("vgg19", "64", 4)) == (0.25, 0.84)


@needs_data
def test_blox_pair_listed_in_both_orders(blox):
    d64, d128 = JobType("DCGAN", "64", 1), JobType("DCGAN", "128", 1)
    # row 338: DCGAN 64 with DCGAN 128 = (0.92, 0.93); row 346: DCGAN 128 with DCGAN 64 = (0.68, 0.68)
    assert blox.pair(d64, d128) == (0.92, 0.93)
    assert blox.pair(d128, d64) == (0.93, 0.92)
    r32, r64 = JobType("resnet50", "32", 1), JobType("resnet50", "64", 1)
    # row 295 (32 with 64) = (0.5, 0.72) beats row 297 (64 with 32) = (0.64, 0.43)
    assert blox.pair(r64, r32) == (0.72, 0.5)


@needs_data
def test_blox_out_of_memory(blox):
    # rows 248/260/272/284/650: GPT2-Medium 4-GPU with resnet50 128 does not fit under any strategy
    gpt, resnet = JobType("GPT2-Medium", "512/8", 4), JobType("resnet50", "128", 4)
    assert blox.pair(gpt, resnet) == (0.0, 0.0)
    assert blox.pair(resnet, gpt) == (0.0, 0.0)
    # row 104 ("18,6") is 0.0 but other strategies fit: the best is row 32 ("10,14", 0.43 + 0.84)
    assert blox.pair(BERT2, JobType("resnet50", "128", 2)) == (0.43, 0.84)


@needs_data
def test_blox_linear_estimate(blox):
    bert8, pointnet8 = BERT2.at(8), POINTNET2.at(8)
    assert blox.knows(bert8) and blox.knows(pointnet8)
    # no 1-GPU Bert-Large: from the largest measured count below 8, 4 GPUs (rows 124-160, 634: row 148 best)
    assert blox.pair(bert8, pointnet8) == (0.37, 1.0)
    assert blox.estimated(bert8, pointnet8)
    assert blox.pair(bert8, pointnet8) == blox.pair(BERT2.at(4), POINTNET2.at(4))
    # a 1-GPU measurement exists: preferred over 2 and 4 GPUs
    r, v = JobType("resnet50", "64", 8), JobType("vgg19", "32", 8)
    assert blox.pair(r, v) == blox.pair(r.at(1), v.at(1)) != blox.pair(r.at(4), v.at(4))
    assert blox.estimated(r, v) and not blox.estimated(r.at(4), v.at(4))
    # out of memory carries over
    assert blox.pair(JobType("GPT2-Medium", "512/8", 8), JobType("resnet50", "128", 8)) == (0.0, 0.0)


@needs_data
def test_blox_unknowns(blox):
    unknown = JobType("AlexNet", "64", 8)
    assert not blox.knows(unknown)
    assert blox.pair(unknown, JobType("resnet50", "64", 8)) is None
    assert not blox.estimated(unknown, JobType("resnet50", "64", 8))
    assert not blox.knows(JobType("Bert-Large", "256/16", 1))  # nothing at fewer GPUs
    assert blox.pair(BERT2.at(1), POINTNET2.at(1)) is None
    with pytest.raises(ValueError, match="GPU counts"):
        blox.pair(BERT2, POINTNET2.at(4))


@needs_data
def test_blox_rejects_gpu_type():
    with pytest.raises(ValueError, match="blox_norm_speed.csv"):
        load_profiles(BLOX, gpu_type="v100")


# -- Gavel table ------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize(
    "gpu, a, b",
    [
        ("v100", "('ResNet-18 (batch size 16)', 1)", "('ResNet-50 (batch size 64)', 1)"),
        ("v100", "('Transformer (batch size 64)', 1)", "('A3C', 1)"),
        ("k80", "('Transformer (batch size 32)', 1)", "('LM (batch size 20)', 1)"),
        ("k80", "('CycleGAN', 1)", "('Recommendation (batch size 512)', 1)"),
    ],
)
def test_gavel_pairs_are_normalised(gavel_raw, gpu, a, b):
    store = load_profiles(GAVEL, gpu_type=gpu)
    ta, tb = parse_gavel_key(a), parse_gavel_key(b)
    expected = gavel_expected(gavel_raw, gpu, a, b)
    assert store.pair(ta, tb) == pytest.approx(expected, rel=1e-12)
    assert store.pair(tb, ta) == pytest.approx(expected[::-1], rel=1e-12)
    assert 0.0 < expected[0] < 1.0  # a slowed-down pair (some rows of the table read (1.0, 1.0))
    assert store.isolated(ta) == gavel_raw[gpu][a]["null"]


@needs_data
def test_gavel_default_gpu_and_multi_gpu(gavel_raw):
    store = load_profiles(GAVEL)
    assert store.source.endswith("[v100]")
    assert len(store.job_types()) == 26 + 3 * 19
    a, b = JobType("ResNet-18", "16", 4), JobType("ResNet-50", "64", 4)
    assert gavel_raw["v100"]["('ResNet-18 (batch size 16)', 4)"]["('ResNet-50 (batch size 64)', 4)"] == [0.0, 0.0]
    assert store.pair(a, b) == store.pair(a.at(1), b.at(1)) != (0.0, 0.0)  # unmeasured, not out of memory
    assert store.estimated(a, b) and not store.estimated(a.at(1), b.at(1))
    # isolated: the table's own multi-GPU entry, else n x the 1-GPU speed
    assert store.isolated(a) == gavel_raw["v100"]["('ResNet-18 (batch size 16)', 4)"]["null"]
    a3c = gavel_raw["v100"]["('A3C', 1)"]["null"]
    assert store.isolated(JobType("A3C", "", 8)) == pytest.approx(8 * a3c)
    assert store.knows(JobType("A3C", "", 8)) and store.isolated(JobType("A3C", "", 1)) == a3c


@needs_data
def test_gavel_out_of_memory_and_unknown_gpu():
    k80 = load_profiles(GAVEL, gpu_type="k80")
    big, small = JobType("ResNet-50", "128", 1), JobType("ResNet-18", "16", 1)
    assert k80.pair(big, small) == (0.0, 0.0)
    assert k80.pair(big.at(2), small.at(2)) == (0.0, 0.0) and k80.estimated(big.at(2), small.at(2))
    with pytest.raises(ValueError, match=r"'a100'.*k80, k80_unconsolidated, p100"):
        load_profiles(GAVEL, gpu_type="a100")


def test_parse_gavel_key():
    assert parse_gavel_key("('ResNet-18 (batch size 16)', 1)") == JobType("ResNet-18", "16", 1)
    assert parse_gavel_key("('Recommendation (batch size 8192)', 4)") == JobType("Recommendation", "8192", 4)
    assert parse_gavel_key("('CycleGAN', 1)") == JobType("CycleGAN", "", 1)
    for bad in ["null", "('ResNet-18 (batch size 16)', 0)", "('ResNet-18 (batch size x)', 1)", "(1, 2)",
                "('a', 1, 2)", "__import__('os')", "('ResNet-18 (batch size 16)', True)", "("]:
        with pytest.raises(ValueError, match="Gavel job"):
            parse_gavel_key(bad)


# -- updates ----------------------------------------------------------------------------------


def test_observe_replaces_unknown_and_estimate_then_blends():
    store = small_store()
    a, b = JobType("A", "8", 1), JobType("B", "8", 1)
    c = JobType("C", "8", 1)
    assert store.pair(a, c) is None and not store.knows(c)
    store.observe(c, a, 0.5, 0.9)
    assert store.pair(a, c) == (0.9, 0.5) and store.knows(c)
    store.observe(a, c, 0.7, 0.3, weight=0.25)  # blends, in the caller's order
    assert store.pair(a, c) == pytest.approx((0.75 * 0.9 + 0.25 * 0.7, 0.75 * 0.5 + 0.25 * 0.3))
    # an estimated 2-GPU pair is replaced outright, and is then measured
    a2, b2 = a.at(2), b.at(2)
    assert store.pair(a2, b2) == (0.6, 0.8) and store.estimated(a2, b2)
    store.observe(b2, a2, 0.4, 0.2)
    assert store.pair(a2, b2) == (0.2, 0.4) and not store.estimated(a2, b2)
    assert store.pair(a, b) == (0.6, 0.8)  # the 1-GPU measurement is untouched
    # "does not fit" is not averaged
    store.observe(a, a, 0.5, 0.5)
    assert store.pair(a, a) == (0.5, 0.5)
    with pytest.raises(ValueError):
        store.observe(a, b, 0.5, 0.5, weight=1.5)
    with pytest.raises(ValueError):
        store.observe(a, b, -0.1, 0.5)


@needs_data
def test_with_noise(blox):
    keys = [(a, b) for a in blox.job_types() for b in blox.job_types() if a <= b and a.gpus == b.gpus]
    measured = {k: blox.pair(*k) for k in keys if blox.pair(*k) is not None and not blox.estimated(*k)}
    assert len(measured) == 330
    one = blox.with_noise(0.2, random.Random(7))
    two = blox.with_noise(0.2, random.Random(7))
    other = blox.with_noise(0.2, random.Random(8))
    changed = 0
    for k, (sa, sb) in measured.items():
        na, nb = one.pair(*k)
        assert (na, nb) == two.pair(*k)
        for s, n in ((sa, na), (sb, nb)):
            assert s * 0.8 - 1e-12 <= n <= s * 1.2 + 1e-12
            changed += n != s
        if (sa, sb) == (0.0, 0.0):
            assert (na, nb) == (0.0, 0.0)
    assert changed > 400
    assert any(one.pair(*k) != other.pair(*k) for k in measured)
    assert blox.pair(BERT2, POINTNET2) == (0.37, 1.0)  # the original is untouched
    same = blox.with_noise(0.0, random.Random(1))
    assert all(same.pair(*k) == v for k, v in measured.items())
    full = blox.with_noise(1.0, random.Random(3))
    assert all(min(full.pair(*k)) >= 0.0 for k in measured)
    for level in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError):
            blox.with_noise(level, random.Random(0))


def test_store_validation():
    a, b = JobType("A", "8", 1), JobType("B", "8", 1)
    with pytest.raises(ValueError):
        JobType("A", "8", 0)
    with pytest.raises(ValueError, match="GPU counts"):
        ProfileStore({}, {(a, b.at(2)): (0.5, 0.5)})
    with pytest.raises(ValueError, match="twice"):
        ProfileStore({}, {(a, b): (0.5, 0.6), (b, a): (0.5, 0.6)})
    assert ProfileStore({}, {(a, b): (0.5, 0.6), (b, a): (0.6, 0.5)}).pair(b, a) == (0.6, 0.5)


# -- bad files --------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="nothere.csv"):
        load_profiles(tmp_path / "nothere.csv")


@pytest.mark.parametrize("name, text, says", [
    ("wrong.csv", "model,speed\nresnet50,1.0\n", "wrong.csv.*missing columns"),
    ("broken.json", '{"v100": {', "broken.json: malformed JSON"),
    ("broken.json", json.dumps({"v100": {"('A (batch size 1)', 1)": {"nul": 1.0}}}), "broken.json: malformed Gavel table"),
])
def test_bad_tables_are_one_line_errors(tmp_path, name, text, says):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=says) as info:
        load_profiles(path)
    assert "\n" not in str(info.value)


def test_bad_csv_row(tmp_path):
    header = ("index,model1,dataset1,gpu_num1,batch_size1,speed1,co_pipeline_rank,pipeline_strategy,"
              "model2,dataset2,gpu_num2,batch_size2,speed2")
    path = tmp_path / "bad_row.csv"
    path.write_text(header + "\n0,resnet50,ImageNet,1,32,fast,0,NA,vgg19,ImageNet,1,32,0.5\n")
    with pytest.raises(ValueError, match="bad_row.csv: line 2"):
        load_profiles(path)
    path.write_text(header + "\n0,resnet50,ImageNet,1,32,0.5,0,NA,vgg19,ImageNet,1,32,0.7\n")
    assert load_profiles(path).pair(JobType("vgg19", "32", 1), JobType("resnet50", "32", 1)) == (0.7, 0.5)
