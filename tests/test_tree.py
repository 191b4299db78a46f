"""Tree packing (turnrl.train.tree) on tiny-qwen3: the trie holds each shared token once, every token attends
exactly to its root-to-token path, and an update on tree rows equals the update on flat rows (loss, gradient
norm, gradients, updated parameters) for groups, forks, compaction branches, VLM groups, LoRA and both
aggregations. The 2-rank FSDP twin is in tests/test_parallel.py (`update-tree`)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from turnrl.build import build_learner
from turnrl.config import TrainConfig
from turnrl.train.learner import Learner
from turnrl.train.loop import PolicyLoss
from turnrl.train.packing import pack_sequences, packed_token_logprobs
from turnrl.train.samples import TrainSample
from turnrl.train.tree import ancestor_mask, families, pack_tree, place, tree_row_routing, tree_token_logprobs

G = torch.Generator().manual_seed(7)


def _ids(n: int) -> list[int]:
    return torch.randint(0, 150_000, (n,), generator=G).tolist()


def _sample(prompt: list[int], response: list[int], mask: list[int] | None = None, advantage: float = 1.0,
            mm=None) -> TrainSample:
    mask = mask if mask is not None else [1] * len(response)
    logprobs = [-11.9 + 0.01 * (k % 5) if m else 0.0 for k, m in enumerate(mask)]  # near the random model's
    return TrainSample(prompt, response, mask, logprobs, advantage, mm)


def grpo_group(n: int = 6, prompt: int = 40) -> list[TrainSample]:
    """A group on one prompt; two samples start their responses alike (a trained token shared by both)."""
    p, start = _ids(prompt), _ids(3)
    return [_sample(p, (start if k < 2 else []) + _ids(8 + k), advantage=(-1.0) ** k * (0.5 + k / 10))
            for k in range(n)]


def forks_after_turn_two(n: int = 4) -> list[TrainSample]:
    """Multi-turn samples identical through two turns and their tool outputs (mask 0), then each its own third
    turn; plus one unrelated sample."""
    p, t1, o1, t2, o2 = _ids(24), _ids(7), _ids(12), _ids(6), _ids(10)
    head, head_mask = t1 + o1 + t2 + o2, [1] * 7 + [0] * 12 + [1] * 6 + [0] * 10
    out = [_sample(p, head + (t3 := _ids(5 + k)), head_mask + [1] * len(t3), advantage=0.3 * (k - 1.5))
           for k in range(n)]
    return [*out, _sample(_ids(15), _ids(9), advantage=0.7)]


def compaction_branches() -> list[TrainSample]:
    """An episode before and after compacting its context: system + task shared, then the long history in the
    first branch and the summary (trained) and the continuation in the second; and another episode's branches."""
    out = []
    for adv in (0.8, -0.6):
        system, task = _ids(18), _ids(10)
        history = _ids(30)
        out.append(_sample(system + task, history, [1 if k % 3 else 0 for k in range(30)], adv))
        summary, rest = _ids(8), _ids(12)
        out.append(_sample(system + task, summary + rest, [1] * 8 + [0] * 4 + [1] * 8, adv))
    return out


def _config(tmp_path, packing: str, **overrides) -> TrainConfig:
    data = {"model": "tiny-qwen3", "train_data": "x", "output_dir": str(tmp_path), "seed": 3,
            "optim": {"lr": 1e-4, "micro_batch_tokens": 4096, "grad_clip": 0.5}, "algo": {"is_mode": "truncate"},
            "trainer": {"packing": packing}}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainConfig.model_validate(data)


def _update(policy, tmp_path, packing: str, samples: list[TrainSample], **overrides) -> tuple[dict, dict, Learner]:
    cfg = _config(tmp_path / packing, packing, **overrides)
    torch.manual_seed(0)  # LoRA's A matrices start random: the same in both learners
    learner = build_learner(cfg, copy.deepcopy(policy))
    metrics = learner.update(samples, PolicyLoss(cfg.algo, version=0), step=1)
    params = {n: p.detach().clone() for n, p in learner.policy.named_parameters() if p.requires_grad}
    grads = {n: p.grad.detach().clone() for n, p in learner.policy.named_parameters() if p.grad is not None}
    return metrics, {"params": params, "grads": grads}, learner


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp(min=1e-12))


def assert_tree_equals_flat(policy, tmp_path, samples: list[TrainSample], **overrides) -> dict:
    flat, flat_state, _ = _update(policy, tmp_path, "flat", samples, **overrides)
    tree, tree_state, _ = _update(policy, tmp_path, "tree", samples, **overrides)
    for key in ("train/loss", "train/grad_norm", "train/tokens"):
        assert tree[key] == pytest.approx(flat[key], rel=1e-5), key
    assert flat_state["grads"].keys() == tree_state["grads"].keys()
    for name, p in flat_state["params"].items():
        # Adam moves an element by about lr whatever the size of its gradient: where the gradient is near Adam's
        # eps (1e-8) its float rounding shows in the step (a zero-initialised vision bias: one element of 64 at
        # 3e-9). Those elements are held to the gradients' check below instead.
        grad = flat_state["grads"].get(name)
        steady = torch.ones_like(p, dtype=torch.bool) if grad is None else grad.abs() > 1e-7
        assert _relative(p * steady, tree_state["params"][name] * steady) <= 1e-5, name
    for name, g in flat_state["grads"].items():  # a sum over tokens that nearly cancels keeps ~1e-5 of rounding
        assert _relative(g, tree_state["grads"][name]) <= 1e-4, name
    assert flat["train/packing_ratio"] == 1.0 and flat["train/tokens_forwarded"] == flat["train/tokens_raw"]
    assert tree["train/tokens_raw"] == flat["train/tokens_raw"]
    assert tree["train/tokens_forwarded"] < tree["train/tokens_raw"]  # every scenario shares something
    assert tree["train/packing_ratio"] == pytest.approx(tree["train/tokens_raw"] / tree["train/tokens_forwarded"])
    return tree


# ---- the trie ------------------------------------------------------------------------------------------------

def test_a_group_is_one_trie_with_each_shared_token_once_at_its_own_position():
    group = grpo_group(4, prompt=10)
    seqs = [(s.prompt_ids, s.response_ids, s.loss_mask) for s in group]
    (row,) = pack_tree(seqs, 4096)
    responses = [s.response_ids for s in group]
    assert row.input_ids.shape[1] == 10 + 3 + sum(len(r) for r in responses) - 2 * 3  # prompt + the 3 shared once
    assert row.tokens_raw == sum(10 + len(r) for r in responses)
    # positions are depths: the prompt 0..9, every response continuing from 10
    ids, pos = row.input_ids[0].tolist(), row.position_ids[0].tolist()
    assert pos[:10] == list(range(10)) and ids[:10] == group[0].prompt_ids
    # each token attends exactly to its root-to-token path, which spells its sample's prefix
    mask = ancestor_mask(row)
    for q in range(len(ids)):
        path = mask[q].nonzero()[:, 0].tolist()
        assert [pos[k] for k in path] == list(range(pos[q] + 1))
        assert any((s.prompt_ids + s.response_ids)[: pos[q] + 1] == [ids[k] for k in path] for s in group)
    # the prompt's last token predicts every sample's first response token (a repeated predicting position)
    firsts = [k for k in range(len(row.targets)) if row.target_pos[k] == 0]
    assert {int(row.predict_at[k]) for k in firsts} == {9}
    assert [int(row.targets[k]) for k in firsts] == [r[0] for r in responses]


def test_tokens_merge_only_at_identical_prefixes():
    a, b = _ids(6), _ids(6)
    tail = _ids(4)
    seqs = [(a, tail, [1] * 4), (b, tail, [1] * 4)]  # the same response after different prompts: nothing shared
    (row,) = pack_tree(seqs, 4096)
    assert row.input_ids.shape[1] == 20
    assert families(seqs) == [[0], [1]]


def test_placement_keeps_a_group_in_one_row_and_bounds_unique_tokens():
    g1, g2, g3 = grpo_group(4, 30), grpo_group(4, 30), grpo_group(4, 30)
    samples = [g1[0], g2[0], g1[1], g3[0], *g1[2:], *g2[1:], *g3[1:]]  # interleaved as a shuffle leaves them
    seqs = [(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples]
    rows = pack_tree(seqs, 140)
    members = [{id(samples[i]) for i in r.sequence_index} for r in rows]
    for group in (g1, g2, g3):
        assert sum({id(s) for s in group} <= m for m in members) == 1  # each group whole in one row
    assert all(r.input_ids.shape[1] <= 140 for r in rows)
    # a group larger than a row is split over rows, never a sample truncated
    big = place(seqs[:1] + [(s.prompt_ids, s.response_ids, s.loss_mask) for s in g1[1:]], 50)
    assert sorted(i for r in big for i in r) == [0, 1, 2, 3] and len(big) > 1


def test_tree_logprobs_equal_flat_with_sdpa_and_flex(tiny_qwen3):
    samples = forks_after_turn_two() + grpo_group(3, 12)
    seqs = [(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples]
    model = copy.deepcopy(tiny_qwen3)
    from turnrl.train.tree import use_tree_attention

    use_tree_attention(model)
    (row,) = pack_tree(seqs, 4096)
    flat = pack_sequences(seqs, 4096)[0]
    with torch.no_grad():
        expected = packed_token_logprobs(model, flat)
        torch.testing.assert_close(tree_token_logprobs(model, row), expected, atol=1e-5, rtol=1e-5)
        row.tree.kernel = "flex"  # FlexAttention's reference (unfused) implementation on the CPU
        with pytest.warns(UserWarning, match="without torch.compile"):
            torch.testing.assert_close(tree_token_logprobs(model, row), expected, atol=1e-5, rtol=1e-5)


def test_cpu_tree_attention_equals_masked_attention_in_output_and_gradients():
    """The CPU kernel (each segment causal on itself, its subtree's queries dense on its keys, merged by
    log-sum-exp; its backward per piece) against one masked SDPA over the ancestor relation, in fp64: a group under
    a shared prompt, a fork two levels deep, a lone sample and one sharing only part of the prompt, GQA 2:1."""
    from turnrl.train.tree import build_tree_row, tree_attention

    prompt = _ids(30)
    seqs = [(prompt, [k, *_ids(6), k], [1] * 8) for k in range(1, 4)]
    seqs += [(prompt, [1, *_ids(4)], [1] * 5), (_ids(3), _ids(2), [1, 1]), (prompt[:12], _ids(3), [1] * 3)]
    row = build_tree_row(seqs, list(range(len(seqs))))
    assert row.tree is not None and sum(e > b for _, b, e in row.tree.spans) >= 2  # two levels of forks
    T = row.input_ids.shape[1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T, 8, dtype=torch.float64, generator=gen).requires_grad_() for h in (4, 2, 2))
    grad = torch.randn(1, T, 4, 8, dtype=torch.float64, generator=gen)
    out, _ = tree_attention(None, q, k, v, None, scaling=0.3, turnrl_tree=row.tree)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=ancestor_mask(row), scale=0.3).transpose(1, 2)
    for a, b in zip(got, [ref, *torch.autograd.grad(ref, (q, k, v), grad)], strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_routing_of_a_tree_row_comes_from_the_samples_through_each_node():
    group = grpo_group(3, 5)
    seqs = [(s.prompt_ids, s.response_ids, s.loss_mask) for s in group]
    (row,) = pack_tree(seqs, 4096)
    routing = [torch.full((len(s.prompt_ids) + len(s.response_ids), 2, 1), k) for k, s in enumerate(group)]
    routing[2] = None
    out = tree_row_routing(row, routing)
    assert out is not None and out.shape == (row.input_ids.shape[1], 2, 1)
    for k, (_, d) in enumerate(row.witness):  # each node from the first sample through it that has routing
        through = [j for j, path in enumerate(row.paths) if k in path.tolist() and routing[j] is not None]
        assert int(out[k, 0, 0]) == (through[0] if through else -1)
        assert row.position_ids[0, k] == d


# ---- tree update == flat update ------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("scenario", [grpo_group, forks_after_turn_two, compaction_branches])
def test_a_tree_update_equals_the_flat_update(tiny_qwen3, tmp_path, scenario, loss_agg):
    tree = assert_tree_equals_flat(tiny_qwen3, tmp_path, scenario(), algo={"loss_agg": loss_agg})
    if scenario is grpo_group:
        assert tree["train/packing_ratio"] > 2


def test_old_and_reference_logprobs_and_rows_over_the_budget(tiny_qwen3, tmp_path):
    """Two mini-batches (the policy's old logprobs), a KL reference, micro-batches that split the groups."""
    samples = grpo_group(4, 30) + forks_after_turn_two(3)
    assert_tree_equals_flat(tiny_qwen3, tmp_path, samples, algo={"kl_coef": 0.1},
                            optim={"mini_batches": 2, "micro_batch_tokens": 96})


def test_lora_tree_update_equals_flat(tiny_qwen3, tmp_path):
    samples = [dataclasses.replace(s, advantage=1.0 + k / 10) for k, s in enumerate(grpo_group(5))]
    # advantages of one sign: the adapters' first gradient (B = 0) is small, and should not cancel to rounding
    tree = assert_tree_equals_flat(tiny_qwen3, tmp_path, samples, algo={"kl_coef": 0.1}, optim={"lr": 1e-3},
                            trainer={"lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}})
    assert tree["train/grad_norm"] > 1e-3


# ---- VLM: images in a shared prompt ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_group():
    from PIL import Image, ImageDraw

    from turnrl.models import load_model, resolve_model
    from turnrl.multimodal import VisionRenderer, build_processor

    renderer = VisionRenderer(build_processor(resolve_model("tiny-qwen3-vl")))

    def image(mark: int):
        im = Image.new("RGB", (48, 32), "white")
        ImageDraw.Draw(im).rectangle([4 + mark, 4, 20 + mark, 20], fill="black")
        return im

    def prompt(mark: int):
        rendered = renderer.initial([{"role": "user", "content": [
            {"type": "image", "image": image(mark)}, {"type": "text", "text": "How many squares?"}]}])
        return rendered.ids, rendered.mm_inputs

    (p1, mm1), (p2, mm2) = prompt(0), prompt(6)
    samples = [_sample(p1, _ids(6 + k) if k else [11, 12, 13], advantage=0.5 - k / 4, mm=mm1) for k in range(4)]
    samples += [_sample(p2, _ids(5 + k), advantage=0.2 * k - 0.1, mm=mm2) for k in range(2)]
    samples.append(_sample(_ids(9), _ids(7), advantage=0.3))  # a text sample among them
    return load_model("tiny-qwen3-vl"), samples, renderer.image_pad_id


def test_a_vlm_group_with_its_image_in_the_shared_prompt(vl_group, tmp_path):
    model, samples, pad = vl_group
    seqs = [(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples]
    (row,) = pack_tree(seqs, 4096, [s.mm_inputs for s in samples], pad)
    images = [s.prompt_ids.count(pad) for s in samples]
    assert row.input_ids[0].tolist().count(pad) == images[0] + images[4]  # each image's tokens once
    assert row.mm_tries == [0, 4]  # and its pixels once, in row order
    overrides = {"model": "tiny-qwen3-vl"}
    tree = assert_tree_equals_flat(model, tmp_path, samples, **overrides)
    assert tree["train/packing_ratio"] > 1.5


def test_vlm_samples_with_different_images_or_an_unshared_image_do_not_merge(vl_group):
    _, samples, pad = vl_group
    a, b = samples[0], samples[4]
    # the same image tokens and text, different pixels: separate tries though their ids agree for a while
    seqs = [(a.prompt_ids, a.response_ids, a.loss_mask), (a.prompt_ids, [5, 6], [1, 1])]
    (row,) = pack_tree(seqs, 4096, [a.mm_inputs, b.mm_inputs], pad)
    assert row.input_ids[0].tolist().count(pad) == 2 * a.prompt_ids.count(pad) and row.mm_tries == [0, 1]
    # identical pixels, but the image tokens come after the prompts diverge: nothing shared
    other = [7] + a.prompt_ids
    (row,) = pack_tree([(a.prompt_ids, [5], [1]), (other, [5], [1])], 4096, [a.mm_inputs, a.mm_inputs], pad)
    assert row.mm_tries == [0, 1] and row.input_ids.shape[1] == len(a.prompt_ids) + len(other) + 2


def test_a_llava_group_shares_its_image_too():
    """LLaVA (1-D positions, a fixed run of image tokens): tree logprobs equal flat ones, the image encoded once."""
    from PIL import Image

    from turnrl.models import load_model, resolve_model
    from turnrl.multimodal import VisionRenderer, build_processor
    from turnrl.train.tree import use_tree_attention

    renderer = VisionRenderer(build_processor(resolve_model("tiny-llava")))
    rendered = renderer.initial([{"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (64, 64), "red")}, {"type": "text", "text": "Colour?"}]}])
    responses = [torch.randint(0, 49_000, (4 + k,), generator=G).tolist() for k in range(3)]
    seqs = [(rendered.ids, r, [1] * len(r)) for r in responses]
    model = load_model("tiny-llava")
    pad = model.config.image_token_index
    (row,) = pack_tree(seqs, 4096, [rendered.mm_inputs] * 3, pad)
    assert row.mm_tries == [0] and row.input_ids[0].tolist().count(pad) == rendered.ids.count(pad)
    flat = pack_sequences(seqs, 4096, [rendered.mm_inputs] * 3)[0]
    use_tree_attention(model)
    with torch.no_grad():
        torch.testing.assert_close(tree_token_logprobs(model, row), packed_token_logprobs(model, flat),
                                   atol=1e-5, rtol=1e-5)
