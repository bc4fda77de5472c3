"""Best-of-n with the committed reward-model members: Coste et al.'s cleanest over-optimisation
setting (arXiv 2310.02743), no PPO and so no seed noise. Three stages, each resumable from its files:

    python -m benchmark.claims.best_of_n sample --out_dir runs/best_of_n       # 64 responses per held-out prompt
    python -m benchmark.claims.best_of_n score --out_dir runs/best_of_n --ensemble runs/reward_ensemble
    python -m benchmark.claims.best_of_n analyse --out_dir runs/best_of_n --out benchmark/results/best_of_n

`sample`: the held-out prompts ppo_rlhf.py evaluates on (its prompt building on --dataset_path's --eval_split, the
first 300 rows as its --num_eval_prompts; --num_prompts: a seeded random subset of them), --num_samples responses each
from the policy at --temperature (1: the policy's own distribution, which the best-of-n KL below is about) and
ppo_rlhf's --response_length, through ppo_rlhf's Sampler (vLLM when importable, else HF generate).
OUT_DIR/samples.jsonl gets a line per response: token ids (up to and including the first EOS), text, has_eos and the
verifier's verdict (ppo_rlhf.verifier_correct); OUT_DIR/meta.json the settings and the prompts' token ids. Prompts are
sampled in chunks of --prompts_per_chunk, each seeded from (--seed, its first prompt) and appended whole; a rerun
keeps the complete chunks and samples the rest (with HF generate a resumed file is the uninterrupted one; with vLLM,
only if its in-process sampler draws from the process's torch generator, which was not checked).

`score`: each member of --ensemble (ppo_rlhf._reward_model_members, all loaded at once) scores every response at its
last real token, centred by its config.bias: what ppo_rlhf.member_scores_of (evaluation's path) gives on the prompt
and the response, to float rounding, but with each prompt's keys and values computed once for its responses
(--chunk_size responses a forward, by length). Scores go to OUT_DIR/scores/<member>.jsonl --batch_size responses at
a time, every member on a batch before the next, so a stage stopped early leaves whole prompts; a rerun scores only
what is missing. A response without EOS is scored like any other: the rule (finished first) is the analysis's.

`analyse`: for n = 1..N (N = --num_samples), the expected verifier accuracy of the response each rule picks from n of
the N samples, over all C(N, n) subsets (not one random draw): sorted by the rule's score, the i-th best of N is the
best of a random n-subset with probability C(N - i, n - 1) / C(N, n); equal keys share their positions' weights (a
random tie-break). A response without EOS is never picked over a finished one (ppo_rlhf's invariant): the key is
(has_eos, score). The rules: each member alone; the mean, WCO (min) and UWO (mean - lambda x variance over the K
members, each --uwo_coef) by ppo_rlhf.ensemble_reward; and WCO on standardised members (each member's score minus its
mean, over its std, both over every sampled response: one scale for all, the zero of this sample). The x-axis is the
best-of-n KL, log n - (n - 1) / n. Intervals: the percentile bootstrap over prompts (--bootstrap resamples, --seed),
the same resamples for every statistic, so differences are paired over prompts. Writes OUT.md (tables and checks),
OUT.png, and OUT.jsonl, a line per prompt with what the analysis reads (verdicts, EOS, member scores: ~2 MB for 282 x
64 x 5, to commit): `analyse --from_responses OUT.jsonl` makes the same table and figure from it alone.

The checks, each held / not held / inconclusive by the rule of benchmark/statistics/registry.py applied to the
bootstrap's 95% interval (held when it lies wholly on the claim's side of the bound, not held when wholly on the other
side, else, or with no spread, inconclusive):
(1) a rule's curve turns down: its accuracy at its peak n minus at n = N, > 0, per prompt with the peak chosen on the
    other half of the prompts (two-fold cross-fitting; a peak chosen on the prompts it is measured on makes the drop
    >= 0 by construction), averaged over --splits seeded random splits into halves (one split is one draw from a
    spread of estimates: a verdict can flip with it); not held when every half of every split peaks at n = N (or the
    curve is back at its maximum there: it saturates). Asked of each member, held only under Holm's procedure over the
    members (one-sided bootstrap p-values, 0.025), and "some member turns down" by Holm over them.
(2) WCO / UWO flatten it: the members' average drop (each member's own drop, averaged per prompt) minus the rule's
    own, > 0, paired over prompts (the mean of the members beside them, in no family); "UWO (some lambda)" and "WCO
    (raw or standardised)" are disjunctions, held by Holm's procedure over the one-sided bootstrap p-values at 0.025
    (registry.holm), not held when every interval lies below 0. Each member's drop minus each rule's is shown
    beside it (intervals, no verdict).
The interval of a cross-fitted statistic, (1) and (2): each prompt's drop is averaged over the splits first (on
every split it is measured at a peak chosen without that prompt, so the average keeps that property), then the
percentile bootstrap resamples the prompts' averaged values, every split's peaks held fixed: the prompts' sampling is
in the interval, the peak choice's own variability is not (as with one split); averaging removes the one split's luck
from the estimate. Each verdict is shown with the share of the splits on which that split alone would have held it
(each split's drops bootstrapped with the same resamples): descriptive, not a test.
(3) the members' disagreement predicts verifier errors: among each rule's picks at n = N, the error rate of the prompts
    whose pick has a members' score std (over K, the centred scores UWO penalises; and on standardised members) above
    the median, minus that of the rest, > 0.
"""

import argparse
import copy
import functools
import importlib.metadata
import json
import math
import os
import sys
import warnings

import numpy as np

from benchmark.statistics.registry import holm, read_jsonl, verdict_inside, write_text

SEED_STRIDE = 1_000_003  # chunk seed = seed * SEED_STRIDE + the chunk's first prompt's position


# ---------------------------------------------------------------------------------------------------------------
# Files


def append_jsonl(path, rows):
    """Append rows to a JSONL file in one write, flushed to disk."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


def rewrite_jsonl(path, rows):
    """Replace a JSONL file with rows (atomically): a resumed stage first drops what a kill left half-written."""
    with open(path + ".tmp", "w") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(path + ".tmp", path)


def read_rows(path):
    return read_jsonl(path) if os.path.isfile(path) else []


def short_float(x):
    """A float32 score as the shortest decimal that reads back to the same float32 (what the analysis compares)."""
    return float(str(np.float32(x)))


# ---------------------------------------------------------------------------------------------------------------
# 1. sample


def chunk_starts(num_prompts, prompts_per_chunk):
    return list(range(0, num_prompts, prompts_per_chunk))


def complete_chunks(rows, positions, num_samples, prompts_per_chunk):
    """The chunk starts (positions in the selected prompt list) whose every prompt has all its samples in rows."""
    counts = {}
    for row in rows:
        counts[row["prompt_index"]] = counts.get(row["prompt_index"], 0) + 1
    done = set()
    for start in chunk_starts(len(positions), prompts_per_chunk):
        chunk = positions[start : start + prompts_per_chunk]
        if all(counts.get(i, 0) == num_samples for i in chunk):
            done.add(start)
    return done


def sample_rows(out_dir, indices, prompts, golds, num_samples, prompts_per_chunk, seed, generate, verify, stop_ids):
    """Sample num_samples responses for each prompt of `indices` (positions into prompts / golds), chunk by chunk,
    appended to out_dir/samples.jsonl; chunks already complete there are kept, anything else there is dropped first.
    generate(prompts, n) -> (responses [B, R], mask [B, R], texts), n consecutive per prompt, after a seed was set by
    seed_everything(chunk seed); verify(texts, golds) -> [B] 1/0. Returns the number of chunks sampled now."""
    path = os.path.join(out_dir, "samples.jsonl")
    rows = read_rows(path)
    done = complete_chunks(rows, indices, num_samples, prompts_per_chunk)
    keep = {i for start in done for i in indices[start : start + prompts_per_chunk]}
    rewrite_jsonl(path, [row for row in rows if row["prompt_index"] in keep])
    sampled = 0
    for start in chunk_starts(len(indices), prompts_per_chunk):
        if start in done:
            continue
        chunk = indices[start : start + prompts_per_chunk]
        seed_everything(seed * SEED_STRIDE + start)
        responses, mask, texts = generate([prompts[i] for i in chunk], num_samples)
        chunk_golds = [golds[i] for i in chunk for _ in range(num_samples)]
        correct = [float(c) for c in verify(texts, chunk_golds)]
        new = []
        for row, text in enumerate(texts):
            ids = [int(t) for t, m in zip(responses[row].tolist(), mask[row].tolist()) if m > 0]
            new.append(
                dict(
                    prompt_index=chunk[row // num_samples], sample=row % num_samples, gold=chunk_golds[row],
                    response_ids=ids, text=text, has_eos=bool(ids) and ids[-1] in stop_ids, correct=correct[row],
                )
            )  # fmt: skip
        append_jsonl(path, new)
        sampled += 1
    return sampled


def seed_everything(seed):
    from accelerate.utils import set_seed

    set_seed(seed)


def select_prompts(num_available, num_prompts, seed):
    """Positions of the prompts to sample: all, or a seeded random subset of num_prompts, in order."""
    if not num_prompts or num_prompts >= num_available:
        return list(range(num_available))
    return sorted(int(i) for i in np.random.default_rng(seed).choice(num_available, num_prompts, replace=False))


MAY_CHANGE = ("samplers", "versions")  # what a resumed sample stage may run with


def check_meta(out_dir, meta):
    """The out_dir/meta.json a resumed stage finds (None if there is none), after checking that it was made with the
    same settings as meta (but MAY_CHANGE): else one line, and the stage stops."""
    path = os.path.join(out_dir, "meta.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        old = json.load(f)
    keys = [k for k in meta if k not in MAY_CHANGE and old.get(k) != meta[k]]
    if keys:
        sys.exit(f"error: {path} was made with other settings ({', '.join(keys)}); use another --out_dir")
    return old


def write_meta(out_dir, meta):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "meta.json") + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(os.path.join(out_dir, "meta.json") + ".tmp", os.path.join(out_dir, "meta.json"))


def script_config(args):
    """ppo_rlhf's Config with this command's settings: its prompts, sampler and models are built from it."""
    import ppo_rlhf

    return ppo_rlhf.Config(
        model_name_or_path=args.model_name_or_path, dataset_path=args.dataset_path, eval_split=args.eval_split,
        response_length=args.response_length, temperature=args.temperature, seed=args.seed, vllm=args.vllm,
        dtype=args.dtype,
    )  # fmt: skip


def sample(args):
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import ppo_rlhf

    config = script_config(args)
    tokenizer = ppo_rlhf._load_tokenizer(config.model_name_or_path, config.trust_remote_code)
    _, _, (prompts, golds), has_gold = ppo_rlhf.load_rlhf_prompts(config, tokenizer, 1)
    if not has_gold:
        sys.exit(f"error: --dataset_path {args.dataset_path} split {args.eval_split} has no gold answers to verify")
    indices = select_prompts(len(prompts), args.num_prompts, args.seed)
    meta = dict(
        model_name_or_path=args.model_name_or_path, dataset_path=args.dataset_path, eval_split=args.eval_split,
        num_samples=args.num_samples, temperature=args.temperature, response_length=args.response_length,
        seed=args.seed, dtype=args.dtype, prompts_per_chunk=args.prompts_per_chunk, prompt_indices=indices,
        pad_token_id=tokenizer.pad_token_id, prompts={str(i): prompts[i] for i in indices},
    )  # fmt: skip
    meta["stop_ids"] = ppo_rlhf._stop_token_ids(tokenizer, config.model_name_or_path)  # the Sampler's
    existing = check_meta(args.out_dir, meta)  # before any model loads: a resumed folder must have these settings
    accelerator = Accelerator()
    policy = ppo_rlhf._load_model(config.model_name_or_path, AutoModelForCausalLM, config, tokenizer.pad_token_id)
    sampler = ppo_rlhf.Sampler(config, accelerator, policy.to(accelerator.device).eval(), tokenizer)
    kind = "vllm" if sampler.llm is not None else "hf_generate"
    meta["samplers"] = sorted({kind, *(existing or {}).get("samplers", [])})  # every sampler the file has rows of
    meta["versions"] = {p: version(p) for p in ("torch", "transformers", "vllm")}
    write_meta(args.out_dir, meta)

    def generate(chunk_prompts, n):
        with torch.no_grad():
            responses, mask, _, texts = sampler.generate(chunk_prompts, n, args.temperature)
        return responses, mask, texts

    verify = lambda texts, chunk_golds: ppo_rlhf.verifier_correct(texts, chunk_golds).tolist()
    try:
        sampled = sample_rows(
            args.out_dir, indices, prompts, golds, args.num_samples, args.prompts_per_chunk, args.seed, generate,
            verify, set(sampler.stop_ids),
        )  # fmt: skip
    finally:
        sampler.close()
    print(f"sampled {sampled} chunk(s) of {args.prompts_per_chunk} prompts; {len(indices)} prompts in {args.out_dir}")


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# 2. score


def score_rows(scorers, samples, batch_size):
    """Score the samples (rows with prompt_index, sample, response_ids) that each path of scorers {path: score_fn}
    (a JSONL of prompt_index, sample, score) does not hold yet, batch_size samples at a time, every scorer on a batch
    before the next batch (so that a stage stopped early leaves whole prompts scored by every member), appending
    each scorer's scores to its path. score_fn(rows) -> [len(rows)] floats. Returns {path: number scored now}."""
    done = {}
    for path in scorers:
        rows = read_rows(path)
        rewrite_jsonl(path, rows)  # without a line a kill cut short
        done[path] = {(row["prompt_index"], row["sample"]) for row in rows}
    todo = [row for row in samples if any((row["prompt_index"], row["sample"]) not in d for d in done.values())]
    scored = dict.fromkeys(scorers, 0)
    for start in range(0, len(todo), batch_size):
        for path, score_fn in scorers.items():
            batch = [r for r in todo[start : start + batch_size] if (r["prompt_index"], r["sample"]) not in done[path]]
            if batch:
                keys = [dict(prompt_index=r["prompt_index"], sample=r["sample"]) for r in batch]
                append_jsonl(path, [key | dict(score=short_float(s)) for key, s in zip(keys, score_fn(batch))])
                scored[path] += len(batch)
    return scored


def score(args):
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification

    import ppo_rlhf

    meta = load_meta(args.out_dir)
    samples = read_rows(os.path.join(args.out_dir, "samples.jsonl"))
    if not samples:
        sys.exit(f"error: no samples in {args.out_dir}/samples.jsonl; run the sample stage first")
    config = ppo_rlhf.Config(model_name_or_path=meta["model_name_or_path"], dtype=args.dtype)
    tokenizer = ppo_rlhf._load_tokenizer(config.model_name_or_path, config.trust_remote_code)
    members = ppo_rlhf._reward_model_members(args.ensemble)
    for member in members:
        ppo_rlhf._check_score_model(member, "ensemble", config.trust_remote_code)
        ppo_rlhf._check_same_vocabulary(member, "ensemble", tokenizer, config.trust_remote_code)
    accelerator, pad_id = Accelerator(), meta["pad_token_id"]
    os.makedirs(os.path.join(args.out_dir, "scores"), exist_ok=True)
    scorers = {}
    for member in members:  # all in memory at once (0.5 GB each for the 135M model in fp32)
        path = os.path.join(args.out_dir, "scores", os.path.basename(os.path.normpath(member)) + ".jsonl")
        model = ppo_rlhf._load_model(member, AutoModelForSequenceClassification, config, pad_id)
        model = ppo_rlhf._frozen(model, accelerator, accelerator.device)
        scorers[path] = functools.partial(
            prompt_cached_scores, model, prompts=meta["prompts"], device=accelerator.device, chunk_size=args.chunk_size
        )
    for path, count in score_rows(scorers, samples, args.batch_size).items():
        print(f"scored {count} response(s) -> {path}")


def prompt_cached_scores(model, rows, prompts, device, chunk_size):
    """A sequence-classification model's score of each row's response (rows: prompt_index, response_ids) at its last
    real token, centred by config.bias: what ppo_rlhf.member_scores_of gives on the prompt and the response alone
    (equal to float rounding: a test checks it), but each prompt's keys and values computed once for its responses
    (a 50-token prompt is most of the tokens of a 10-30-token response) and copied for each chunk. A prompt's responses
    go in chunks of chunk_size by length (short with short: less padding). Returns [len(rows)] floats, rows' order."""
    import torch

    backbone, bias = getattr(model, model.base_model_prefix), float(getattr(model.config, "bias", 0.0))
    by_prompt, scores = {}, [0.0] * len(rows)
    for i, row in enumerate(rows):
        by_prompt.setdefault(row["prompt_index"], []).append(i)
    for index, members in by_prompt.items():
        prompt = torch.tensor([prompts[str(index)]], device=device)
        members = sorted(members, key=lambda i: len(rows[i]["response_ids"]))
        with torch.no_grad():
            prompt_cache = backbone(input_ids=prompt, use_cache=True).past_key_values  # once per prompt
        for start in range(0, len(members), chunk_size):
            chunk = members[start : start + chunk_size]
            lengths = torch.tensor([len(rows[i]["response_ids"]) for i in chunk], device=device)
            if int(lengths.min()) < 1:
                raise ValueError(f"prompt {index}: an empty response cannot be scored at its last token")
            ids = torch.zeros(len(chunk), int(lengths.max()), dtype=torch.long, device=device)  # right-padded
            for row, i in enumerate(chunk):
                ids[row, : lengths[row]] = torch.tensor(rows[i]["response_ids"], device=device)
            width, P = ids.shape[1], prompt.shape[1]
            mask = torch.cat([torch.ones(len(chunk), P, dtype=torch.long, device=device),
                              (torch.arange(width, device=device) < lengths[:, None]).long()], 1)  # fmt: skip
            with torch.no_grad():
                cache = copy.deepcopy(prompt_cache)  # the forward below appends to it
                cache.batch_repeat_interleave(len(chunk))
                positions = torch.arange(P, P + width, device=device).expand(len(chunk), width)
                hidden = backbone(
                    input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
                ).last_hidden_state
                last = model.score(hidden[torch.arange(len(chunk)), lengths - 1]).squeeze(-1).float()
            for row, i in enumerate(chunk):
                scores[i] = last[row].item() - bias
    return scores


def load_meta(out_dir):
    path = os.path.join(out_dir, "meta.json")
    if not os.path.isfile(path):
        sys.exit(f"error: no {path}; run `python -m benchmark.claims.best_of_n sample --out_dir {out_dir}` first")
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------------
# 3. analyse: the estimator and the rules


def pick_weights(N):
    """W [N, N], W[n - 1, i] = C(N - 1 - i, n - 1) / C(N, n): the probability that the (i + 1)-th best of N distinct
    responses is the best of a uniformly random n-subset (it is in the subset, the other n - 1 are below it). Each
    row sums to 1 (float64, exact binomials)."""
    W = np.zeros((N, N))
    for n in range(1, N + 1):
        total = math.comb(N, n)
        for i in range(N - n + 1):
            W[n - 1, i] = math.comb(N - 1 - i, n - 1) / total
    return W


def best_of_n_values(score, has_eos, values, W):
    """The expected value (values [N] or [N, m]: verdicts, a disagreement) of the response best-of-n picks, for
    n = 1..N, over all C(N, n) subsets: the key is (has_eos, score), highest best, so that a response without EOS is
    never picked over a finished one; equal keys share their positions' weights (a uniformly random tie-break).
    Returns [N] or [N, m]."""
    score, has_eos, values = np.asarray(score, float), np.asarray(has_eos, bool), np.asarray(values, float)
    order = np.lexsort((-score, ~has_eos))  # finished first, then by score, descending
    keys = list(zip(has_eos[order].tolist(), score[order].tolist()))
    v = values[order].copy()
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            v[start:i] = v[start:i].mean(0)
            start = i
    return W @ v


def kl_best_of_n(n):
    """The KL of best-of-n sampling to the policy: log n - (n - 1) / n (Stiennon et al.; Coste et al.'s x-axis)."""
    n = np.asarray(n, float)
    return np.log(n) - (n - 1) / n


def standardised(S):
    """S [P, K, N] -> each member's scores minus its mean, over its std, both over every response (ddof 0)."""
    flat = S.transpose(1, 0, 2).reshape(S.shape[1], -1)
    return (S - flat.mean(1)[None, :, None]) / flat.std(1)[None, :, None]


def rule_scores(S, member_names, uwo_coefs):
    """{rule: [P, N] score} for S [P, K, N] centred member scores: each member alone, the mean, WCO, WCO on
    standardised members, UWO at each lambda (ppo_rlhf.ensemble_reward, the training scripts' rule)."""
    import torch

    import ppo_rlhf

    P, K, N = S.shape
    flat = torch.from_numpy(np.ascontiguousarray(S.transpose(1, 0, 2).reshape(K, P * N)))  # [K, P * N] float64
    combine = lambda x, rule, coef=0.0: ppo_rlhf.ensemble_reward(x, rule, coef).numpy().reshape(P, N)
    rules = {name: S[:, k] for k, name in enumerate(member_names)}
    if K > 1:
        rules["mean"] = combine(flat, "mean")
        rules["wco"] = combine(flat, "wco")
        Z = torch.from_numpy(np.ascontiguousarray(standardised(S).transpose(1, 0, 2).reshape(K, P * N)))
        rules["wco_std"] = combine(Z, "wco")
        for coef in uwo_coefs:
            rules[f"uwo_{coef:g}"] = combine(flat, "uwo", coef)
    return rules


def rule_label(name):
    if name == "wco_std":
        return "WCO, standardised members"
    if name.startswith("uwo_"):
        return f"UWO, lambda {name[4:]}"
    return {"mean": "mean", "wco": "WCO"}.get(name, name)


# ---------------------------------------------------------------------------------------------------------------
# The bootstrap over prompts and the verdicts


def bootstrap_counts(num_prompts, num_resamples, seed):
    """[B, P]: how often each prompt is drawn in each of B resamples of P prompts with replacement (numpy's
    default_rng(seed): the same resamples for every statistic, so that differences are paired over prompts)."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, num_prompts, size=(num_resamples, num_prompts))
    offsets = (np.arange(num_resamples) * num_prompts)[:, None]
    return np.bincount((draws + offsets).ravel(), minlength=num_resamples * num_prompts).reshape(
        num_resamples, num_prompts
    )


def bootstrap_means(counts, per_prompt):
    """The mean over each resample's prompts of per_prompt [P, ...]: [B, ...]."""
    P = counts.shape[1]
    return (counts @ per_prompt.reshape(P, -1) / P).reshape(len(counts), *per_prompt.shape[1:])


def percentile_interval(boot):
    """The 95% percentile interval (2.5th and 97.5th percentiles over axis 0; NaN resamples left out)."""
    with warnings.catch_warnings():  # a statistic no resample defines (an empty half): NaN, so inconclusive
        warnings.simplefilter("ignore", RuntimeWarning)
        low, high = np.nanpercentile(boot, [2.5, 97.5], axis=0)
    return low, high


def p_above(boot, bound=0.0):
    """The one-sided bootstrap p-value of "above bound": (1 + resamples at or below it) / (1 + resamples)."""
    boot = boot[~np.isnan(boot)]
    return (1 + int((boot <= bound).sum())) / (1 + len(boot))


def bootstrap_verdict(low, high, bound=0.0):
    """The registry's rule on a bootstrap interval for "statistic > bound": held when it lies wholly above the
    bound, not held when wholly below, inconclusive when it crosses it or has no spread (no interval)."""
    spread = high - low > 1e-12 * max(1.0, abs(high))
    return verdict_inside((low + high) / 2, (high - low) / 2 if spread else None, bound, math.inf)


def family_verdict(boots, bound=0.0):
    """Whether some arm of these is above bound (a disjunction): held when Holm's procedure over the one-sided p-values
    rejects at 0.025 (registry.holm), not held when every interval lies wholly below the bound, else inconclusive."""
    if any(holm([p_above(b, bound) for b in boots])):
        return "held"
    if all(bootstrap_verdict(*percentile_interval(b), bound) == "not held" for b in boots):
        return "not held"
    return "inconclusive"


# ---------------------------------------------------------------------------------------------------------------
# The analysis


def load_responses(out_dir):
    """Per prompt, what the analysis reads, from out_dir's samples.jsonl and scores/*.jsonl: the prompts with all
    their samples and every member's score of each. Returns (rows, member names, prompts left out)."""
    meta = load_meta(out_dir)
    N = meta["num_samples"]
    samples = read_rows(os.path.join(out_dir, "samples.jsonl"))
    score_dir = os.path.join(out_dir, "scores")
    names = sorted(f[: -len(".jsonl")] for f in os.listdir(score_dir) if f.endswith(".jsonl"))
    if not names:
        sys.exit(f"error: no scores in {score_dir}; run `python -m benchmark.claims.best_of_n score` first")
    scores = {}
    for name in names:
        rows = read_rows(os.path.join(score_dir, name + ".jsonl"))
        scores[name] = {(r["prompt_index"], r["sample"]): r["score"] for r in rows}
    by_prompt = {}
    for row in samples:
        by_prompt.setdefault(row["prompt_index"], {})[row["sample"]] = row
    rows, left_out = [], 0
    for index in sorted(by_prompt):
        got = by_prompt[index]
        if sorted(got) != list(range(N)) or any((index, j) not in scores[m] for m in names for j in range(N)):
            left_out += 1
            continue
        rows.append(
            dict(
                prompt_index=index, gold=got[0].get("gold"), correct=[got[j]["correct"] for j in range(N)],
                has_eos=[bool(got[j]["has_eos"]) for j in range(N)],
                scores={m: [scores[m][(index, j)] for j in range(N)] for m in names},
            )
        )  # fmt: skip
    return rows, names, left_out


def arrays(rows, names):
    """(C [P, N] verdicts, E [P, N] has_eos, S [P, K, N] member scores as float32 read to float64)."""
    C = np.asarray([r["correct"] for r in rows], float)
    E = np.asarray([r["has_eos"] for r in rows], bool)
    S = np.asarray([[r["scores"][m] for m in names] for r in rows], np.float32).astype(np.float64)
    return C, E, S


def analysis(rows, names, uwo_coefs, num_resamples, seed, num_splits=200):
    """Everything the table, the checks and the figure show, from per-prompt rows (load_responses). Returns a dict."""
    C, E, S = arrays(rows, names)
    P, K, N = S.shape
    W = pick_weights(N)
    rules = rule_scores(S, names, uwo_coefs)
    disagreement = np.stack([S.std(1), standardised(S).std(1)], -1)  # [P, N, 2]: members' std, raw and standardised
    curves, picks = {}, {}  # [P, N] accuracy by n; [P, 2] the n = N pick's disagreement (raw, standardised)
    for name, R in rules.items():
        per = [best_of_n_values(R[p], E[p], np.concatenate([C[p][:, None], disagreement[p]], 1), W) for p in range(P)]
        per = np.stack(per)  # [P, N(n), 3]
        curves[name], picks[name] = per[:, :, 0], per[:, N - 1, 1:]
    counts = bootstrap_counts(P, num_resamples, seed)
    out = dict(num_prompts=P, num_samples=N, members=names, rules=list(rules), eos_fraction=float(E.mean()))
    out["prompts_without_finished"] = int((~E.any(1)).sum())
    out["n"], out["kl"] = np.arange(1, N + 1), kl_best_of_n(np.arange(1, N + 1))
    out["curves"] = curves  # [P, N] per rule: each prompt's expected accuracy by n
    out["accuracy"] = {name: c.mean(0) for name, c in curves.items()}
    out["interval"] = {name: percentile_interval(bootstrap_means(counts, c)) for name, c in curves.items()}
    out["members_average"] = np.mean([out["accuracy"][name] for name in names], 0)
    # (1) and (2) on the drop from the peak to n = N, per prompt, the peak chosen on the other half of the prompts
    # (two-fold cross-fitting): a peak chosen on the prompts it is measured on makes the drop >= 0 by construction. One
    # split is one draw: the estimate is each prompt's drop averaged over num_splits seeded splits (a prompt's drop is
    # measured at a peak chosen without it on every split), bootstrapped over prompts with every split's peaks fixed.
    halves = prompt_splits(P, seed, num_splits)
    per_split, peaks = {}, {}  # [S, P] drops; [(half 1's peak n, half 2's)] * S
    for name in rules:
        per_split[name], peaks[name] = split_drops(curves[name], halves)
    averaged = {name: d.mean(0) for name, d in per_split.items()}
    out |= cross_fitted_checks(averaged, [peak for peak in zip(*peaks.values())], counts, names, N)
    out["peak_n"] = {name: tuple(n for pair in p for n in pair) for name, p in peaks.items()}
    # What would decide each flattening: the prompts its interval needs for 80% power at the per-prompt values seen
    # here, alone and, for a family's arm of smallest p, at Holm's first step (0.025 / the family's size).
    average = np.mean([averaged[name] for name in names], 0)
    flat = {name: average - averaged[name] for name in out["flatten"]}
    out["flatten_prompts"] = {name: prompts_needed(values) for name, values in flat.items()}
    out["family_prompts"] = {}
    for family, members in families(list(out["flatten"])).items():
        best = min(members, key=lambda name: out["flatten"][name][4])
        out["family_prompts"][family] = (best, prompts_needed(flat[best], 0.025 / len(members)))
    # What one split alone would have said, split by split (descriptive: the share of splits with each verdict held).
    singles = [
        cross_fitted_checks({name: d[s] for name, d in per_split.items()}, [[p[s] for p in peaks.values()]], counts,
                            names, N)
        for s in range(num_splits)
    ]  # fmt: skip
    out["split_held"] = dict(
        drop={name: share(c["drop"][name][3] == "held" for c in singles) for name in rules},
        members_turn_down=share(c["members_turn_down"] == "held" for c in singles),
        flatten={name: share(c["flatten"][name][3] == "held" for c in singles) for name in out["flatten"]},
        flatten_family={f: share(c["flatten_family"][f] == "held" for c in singles) for f in out["flatten_family"]},
    )
    # (3) the n = N pick's error rate above against at or below the median disagreement
    out["disagreement"] = {}
    for name in rules:
        err = 1.0 - curves[name][:, N - 1]
        results = []
        for j in range(2):
            d = picks[name][:, j]
            top = (d > np.median(d)).astype(float)
            bottom = 1.0 - top
            with np.errstate(invalid="ignore", divide="ignore"):
                boot = (counts @ (err * top)) / (counts @ top) - (counts @ (err * bottom)) / (counts @ bottom)
            low, high = percentile_interval(boot)
            rates = (float((err * top).sum() / max(top.sum(), 1)), float((err * bottom).sum() / max(bottom.sum(), 1)))
            results.append((*rates, rates[0] - rates[1], float(low), float(high), bootstrap_verdict(low, high)))
        out["disagreement"][name] = results
    out["bootstrap"], out["seed"], out["splits"] = num_resamples, seed, num_splits
    return out


def share(flags):
    flags = list(flags)
    return sum(flags) / len(flags)


def cross_fitted_checks(drops, split_peaks, counts, names, N):
    """Checks (1) and (2) from per-prompt drops {rule: [P]} (one split's, or averaged over splits) and the peaks they
    were measured at (split_peaks: per split, per rule in drops' order, (half 1's peak n, half 2's)), the bootstrap
    resamples counts [B, P] shared by every statistic. Returns {drop, members_turn_down, average_drop, flatten,
    flatten_each, flatten_family}."""
    rules = list(drops)
    out = dict(drop={}, flatten={}, flatten_family={}, flatten_each={})
    boot_drop = {name: bootstrap_means(counts, d) for name, d in drops.items()}
    # Each member's "turns down" is one of K tries: held only where Holm's procedure over the members rejects.
    member_holm = dict(zip(names, holm([p_above(boot_drop[name]) for name in names])))
    for i, name in enumerate(rules):
        low, high = percentile_interval(boot_drop[name])
        verdict = bootstrap_verdict(low, high)
        if all(split[i] == (N, N) for split in split_peaks):
            verdict = "not held (peak at n = N)"
        elif name in member_holm and verdict == "held" and not member_holm[name]:
            verdict = "inconclusive (not under Holm)"
        out["drop"][name] = (float(drops[name].mean()), float(low), float(high), verdict)
    out["members_turn_down"] = family_verdict([boot_drop[name] for name in names])
    # (2) the members' average drop (each member's own, per prompt, averaged) minus each conservative rule's, paired
    # over prompts; and each member's drop minus each rule's (no verdict)
    conservative = [name for name in rules if name.startswith(("mean", "wco", "uwo_"))]  # the mean: no family
    average = np.mean([drops[name] for name in names], 0)
    boot_average = bootstrap_means(counts, average)
    out["average_drop"] = (float(average.mean()), *map(float, percentile_interval(boot_average)))
    boot_flat = {name: boot_average - boot_drop[name] for name in conservative}
    for name in conservative:
        low, high = percentile_interval(boot_flat[name])
        diff = float((average - drops[name]).mean())
        out["flatten"][name] = (diff, float(low), float(high), bootstrap_verdict(low, high), p_above(boot_flat[name]))
        out["flatten_each"][name] = {
            member: (
                float((drops[member] - drops[name]).mean()),
                *map(float, percentile_interval(boot_drop[member] - boot_drop[name])),
            )
            for member in names
        }
    for family, members in families(conservative).items():
        out["flatten_family"][family] = family_verdict([boot_flat[name] for name in members])
    return out


def families(conservative):
    """{family: its rules} of the disjunctions "WCO (raw or standardised)" and "UWO (some lambda)" among the
    conservative rules there are."""
    found = {
        "WCO (raw or standardised)": [name for name in ("wco", "wco_std") if name in conservative],
        "UWO (some lambda)": [name for name in conservative if name.startswith("uwo_")],
    }
    return {family: members for family, members in found.items() if members}


def prompts_needed(values, alpha=0.025):
    """The prompts at which the rule's interval decides "mean > 0" with 80% power, at these per-prompt values' mean and
    std as if they were the truth (benchmark.statistics.power.seeds_needed: normal theory, one-sided level alpha); None
    beyond 10,000."""
    from benchmark.statistics import power

    return power.seeds_needed(float(np.mean(values)), float(np.std(values, ddof=1)), 0.0, math.inf, alpha=alpha)


def cross_fitted_drops(curve, half):
    """curve [P, N] (a prompt's accuracy by n), half [P] 0 or 1. Each prompt's drop from the peak to n = N, the peak
    (peak_index of the mean curve) chosen on the other half's prompts. Returns ([P] drops, (half 0's peak index,
    half 1's))."""
    peaks = tuple(peak_index(curve[half == h].mean(0)) for h in (0, 1))
    at_peak = curve[np.arange(len(curve)), np.where(half == 0, peaks[1], peaks[0])]
    return at_peak - curve[:, -1], peaks


def split_drops(curve, halves):
    """curve [P, N], halves [S, P]: each prompt's cross-fitted drop (cross_fitted_drops) on each split, [S, P], and
    each split's (half 1's peak n, half 2's peak n), counted from 1."""
    fitted = [cross_fitted_drops(curve, half) for half in halves]
    return np.stack([d for d, _ in fitted]), [tuple(int(i) + 1 for i in peak) for _, peak in fitted]


def prompt_halves(num_prompts, seed):
    """[P] 0 or 1: a seeded random split of the prompts into two halves (sizes differing by at most one)."""
    return prompt_splits(num_prompts, seed, 1)[0]


def prompt_splits(num_prompts, seed, num_splits):
    """[S, P] 0 or 1: num_splits seeded random splits of the prompts into two halves (sizes differing by at most one),
    drawn one after another from one generator, so that the first is prompt_halves(num_prompts, seed)."""
    rng = np.random.default_rng([seed, 2])
    halves = np.zeros((num_splits, num_prompts), int)
    for split in halves:
        split[rng.permutation(num_prompts)[num_prompts // 2 :]] = 1
    return halves


def peak_index(accuracy):
    """The index of a curve's peak: its first maximum, or the last index where the last value is the maximum up to
    float rounding (1e-12)."""
    best = int(np.argmax(accuracy))
    return len(accuracy) - 1 if accuracy[-1] >= accuracy[best] - 1e-12 else best


def shown_ns(N):
    ns = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n < N]
    return ns + [N]


def count(n):
    return "> 10,000" if n is None else f"{n:,}"


def signed_interval(mean, low, high):
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def markdown(result, meta_line=""):
    """The tables and the checks of analysis()."""
    N, members, splits = result["num_samples"], result["members"], result["splits"]
    ns = shown_ns(N)
    lines = [
        f"Best-of-n on {result['num_prompts']} held-out prompts x {N} samples, {len(result['members'])} members "
        f"({', '.join(result['members'])}){meta_line}. Verifier accuracy of the pick, expected over all n-subsets of "
        f"the {N} samples; [95% interval]: percentile bootstrap over prompts, {result['bootstrap']} resamples, seed "
        f"{result['seed']}. Responses with EOS: {result['eos_fraction']:.3f}; prompts with no finished response: "
        f"{result['prompts_without_finished']}. A response without EOS is never picked over a finished one.",
        "",
        "| rule | " + " | ".join(f"n={n} (KL {kl_best_of_n(n):.2f})" for n in ns) + " | peak n, median (min-max)"
        " over the halves | drop, other half's peak → N | turns down? | held on single splits |",
        "| --- | " + " | ".join("---" for _ in ns) + " | --- | --- | --- | --- |",
    ]
    held = result["split_held"]
    for name in result["rules"]:
        acc = result["accuracy"][name]
        mean, low, high, verdict = result["drop"][name]
        cells = " | ".join(f"{acc[n - 1]:.3f}" for n in ns)
        peak_n = result["peak_n"][name]
        peaks = f"{np.median(peak_n):g} ({min(peak_n)}-{max(peak_n)})"
        lines.append(
            f"| {rule_label(name)} | {cells} | {peaks} | {signed_interval(mean, low, high)} | {verdict} | "
            f"{held['drop'][name]:.0%} |"
        )
    lines += [
        "",
        f"Each prompt's drop is measured at the peak chosen on the other half of the prompts, and averaged over "
        f"{splits} seeded random splits into halves (the registered estimate; its interval bootstraps the prompts' "
        'split-averaged drops, every split\'s peaks held fixed); "held on single splits": the share of the splits '
        'on which that split alone would have held it (descriptive, not a test). A member\'s "turns down" is held '
        "only under Holm's procedure over the members (0.025 a side).",
        f"- Some member turns down (Holm over the {len(members)} members): **{result['members_turn_down']}** (held on "
        f"{held['members_turn_down']:.0%} of single splits)",
    ]
    if result["flatten"]:
        lines += [
            "",
            "Do the conservative rules flatten the members' curves? The members' average drop (each member's own, "
            f"{signed_interval(*result['average_drop'])}) minus the rule's own, paired over prompts (claim: > 0); "
            "then each member's drop minus the rule's (no verdict).",
            "",
            "| rule | drop → N | average member's drop − rule's | one-sided p | verdict | held on single splits | "
            "prompts to decide it (80% power, alone) | "
            + " | ".join(f"{member}'s − rule's" for member in members)
            + " |",
            "| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in members) + " |",
        ]
        for name, (diff, low, high, verdict, p) in result["flatten"].items():
            each = " | ".join(signed_interval(*result["flatten_each"][name][member]) for member in members)
            lines.append(
                f"| {rule_label(name)} | {result['drop'][name][0]:+.3f} | {signed_interval(diff, low, high)} | "
                f"{p:.4f} | {verdict} | {held['flatten'][name]:.0%} | "
                f"{count(result['flatten_prompts'][name]) if verdict == 'inconclusive' else '– (decided)'} | "
                f"{each} |"
            )
        lines += [""]
        for family, verdict in result["flatten_family"].items():
            best, prompts = result["family_prompts"][family]
            size = len(families(list(result["flatten"]))[family])
            needs = (
                ""
                if verdict != "inconclusive"
                else f"; its arm of smallest p, {rule_label(best)}, needs {count(prompts)} prompts for 80% power at "
                f"Holm's first step (0.025 / {size})"
                if result["flatten"][best][0] > 0
                else "; no arm's difference is above 0"
            )
            lines.append(
                f"- {family} flattens them (Holm over the family at 0.025): **{verdict}** (held on "
                f"{held['flatten_family'][family]:.0%} of single splits{needs})"
            )
        lines += [
            "",
            "Prompts to decide: where the rule's interval decides the claim with 80% power, at the per-prompt "
            f"(split-averaged) differences' mean and std seen on these {result['num_prompts']} as if they were the "
            "truth (benchmark.statistics.power.seeds_needed, normal theory).",
        ]
    lines += [
        "",
        f"Does the members' disagreement predict verifier errors? Among each rule's picks at n = {N}: the error rate "
        "where the pick's members' score std (over the members: centred scores, and standardised members) is above "
        "its median over prompts, against at or below it (claim: above − below > 0).",
        "",
        "| rule | error, std above / below (centred) | difference | verdict | error, std above / below "
        "(standardised) | difference | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in result["rules"]:
        cells = []
        for above, below, diff, low, high, verdict in result["disagreement"][name]:
            cells += [f"{above:.3f} / {below:.3f}", signed_interval(diff, low, high), verdict]
        lines.append(f"| {rule_label(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result, out):
    """Accuracy of the pick against the best-of-n KL, 95% bootstrap bands: the members and their mean on the left,
    the conservative rules (with the members' average, dashed) on the right. Writes a PNG, returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    members, rules, kl = result["members"], result["rules"], result["kl"]
    panels = [
        ("members alone and their mean", [*members, *(["mean"] if "mean" in rules else [])]),
        ("conservative rules (the members' average dashed)", [r for r in rules if r.startswith(("wco", "uwo_"))]),
    ]
    panels = [(title, names) for title, names in panels if names]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False, sharey=True)
    for ax, (title, names) in zip(axes.flat, panels):
        if not title.startswith("members"):
            ax.plot(kl, result["members_average"], color="gray", linestyle="--", label="members' average")
        for i, name in enumerate(names):
            low, high = result["interval"][name]
            ax.plot(kl, result["accuracy"][name], color=f"C{i % 10}", label=rule_label(name))
            ax.fill_between(kl, low, high, color=f"C{i % 10}", alpha=0.15, linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("KL of best-of-n, log n - (n - 1) / n (nats)")
        if ax is axes.flat[0]:
            ax.set_ylabel("verifier accuracy of the pick")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        top = ax.secondary_xaxis("top")
        ticks = shown_ns(result["num_samples"])
        top.set_xticks(kl_best_of_n(ticks), [str(n) for n in ticks])
        top.set_xlabel("n", fontsize=8)
    fig.suptitle(f"Best-of-n, {result['num_prompts']} prompts x {result['num_samples']} samples", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def analyse(args):
    if args.from_responses:
        rows = read_jsonl(args.from_responses)
        names, left_out = list(rows[0]["scores"]), 0
    else:
        rows, names, left_out = load_responses(args.out_dir)
        if left_out:
            print(f"warning: {left_out} prompt(s) lack samples or scores and are left out", file=sys.stderr)
    if not rows:
        sys.exit("error: no prompt has all its samples scored by every member")
    result = analysis(rows, names, args.uwo_coef, args.bootstrap, args.seed, args.splits)
    note = f"; {left_out} prompt(s) left out (not yet sampled or scored)" if left_out else ""
    write_text(markdown(result, note), args.out + ".md")
    print(f"wrote {plot(result, args.out + '.png')}", file=sys.stderr)
    if not args.from_responses:
        rewrite_jsonl(args.out + ".jsonl", rows)
        print(f"wrote {args.out}.jsonl", file=sys.stderr)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Command line


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmark.claims.best_of_n", description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["sample", "score", "analyse"], help="the stage to run (each resumes)")
    parser.add_argument("--out_dir", default="runs/best_of_n", help="samples.jsonl, meta.json and scores/ (all)")
    parser.add_argument("--seed", type=int, default=1, help="sampling (sample) and the bootstrap (analyse)")
    group = parser.add_argument_group("sample")
    group.add_argument("--model_name_or_path", default="assets/SmolLM2-135M-Instruct", help="the policy")
    group.add_argument("--dataset_path", default="assets/data/arith_1d", help="as ppo_rlhf.py's")
    group.add_argument("--eval_split", default="test", help="the held-out split ppo_rlhf.py evaluates on")
    group.add_argument("--num_samples", type=int, default=64, help="N: responses per prompt")
    group.add_argument("--num_prompts", type=int, default=None, help="a seeded random subset (default: all)")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--response_length", type=int, default=64, help="ppo_rlhf.py's default")
    group.add_argument("--prompts_per_chunk", type=int, default=4, help="prompts sampled (and saved) at a time")
    group.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True, help="else HF generate")
    group.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="models (sample, score)")
    group = parser.add_argument_group("score")
    group.add_argument("--ensemble", default="runs/reward_ensemble", help="a folder of reward models (or one)")
    group.add_argument("--batch_size", type=int, default=64, help="responses scored (and saved) at a time")
    group.add_argument("--chunk_size", type=int, default=16, help="a prompt's responses per forward, by length")
    group = parser.add_argument_group("analyse")
    group.add_argument("--uwo_coef", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0], help="UWO lambdas")
    group.add_argument("--bootstrap", type=int, default=2000, help="resamples of the prompts")
    group.add_argument(
        "--splits",
        type=int,
        default=200,
        help="random halvings of the prompts the cross-fitted drops are averaged over",
    )
    group.add_argument("--out", default="benchmark/results/best_of_n", help="writes OUT.md, OUT.png, OUT.jsonl")
    group.add_argument("--from_responses", default=None, help="analyse an OUT.jsonl (committed) instead of --out_dir")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("num_samples", "prompts_per_chunk", "batch_size", "chunk_size", "bootstrap", "splits"):
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name} must be at least 1, got {getattr(args, name)}")
    if args.num_prompts is not None and args.num_prompts < 1:
        sys.exit(f"error: --num_prompts must be at least 1, got {args.num_prompts}")
    return {"sample": sample, "score": score, "analyse": analyse}[args.stage](args)


if __name__ == "__main__":
    main()
