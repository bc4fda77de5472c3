"""The members of a reward-model ensemble on their shared held-out pairs: each member's pair accuracy, how
often the members agree, and the accuracy of the ensemble's combinations (ppo_rlhf.ensemble_reward):

    python -m benchmark.claims.reward_ensemble --ensemble runs/reward_ensemble \
        --out benchmark/results/reward_ensemble.md

The pairs are the held-out preferences the first member's run wrote (its preferences/test.jsonl, found through
the run folder named in the member's training run; or --pairs), the very ones every member was evaluated on when
they share --data_seed. A pair counts as right when the chosen response scores above the rejected one (ties wrong,
as in reward_modeling.py). Agreement: the fraction of pairs on which two members prefer the same response
(averaged over the member pairs), and the fraction on which all of them do.
"""

import argparse
import glob
import itertools
import json
import os

import torch
from transformers import AutoModelForSequenceClassification

import ppo_rlhf
import reward_modeling as rm
from benchmark.statistics.registry import read_jsonl


def agreement(prefers_chosen):
    """prefers_chosen [K, N] bool: member k prefers the chosen response of pair n. Returns (the mean over the
    K (K - 1) / 2 member pairs of the fraction of pairs they agree on, the fraction all K agree on); K = 1: (1, 1)."""
    K = len(prefers_chosen)
    pairwise = [
        (prefers_chosen[a] == prefers_chosen[b]).float().mean().item() for a, b in itertools.combinations(range(K), 2)
    ]
    unanimous = (prefers_chosen.all(0) | (~prefers_chosen).all(0)).float().mean().item()
    return (sum(pairwise) / len(pairwise) if pairwise else 1.0), unanimous


def member_scores(path, pairs, batch_size=16):
    """A member's centred scores (score - config.bias) of the chosen and of the rejected responses: ([N], [N])."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    pad_id, bias = model.config.pad_token_id, float(getattr(model.config, "bias", 0.0))
    chosen, rejected = [], []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            c, r = rm.pair_scores(model, model.score, pairs[start : start + batch_size], pad_id, "cpu")
            chosen.append(c - bias)
            rejected.append(r - bias)
    return torch.cat(chosen), torch.cat(rejected)


def held_out_pairs(member, pairs_path=None):
    """(chosen ids, rejected ids) of the held-out preferences: --pairs, else the preferences/test.jsonl of the run that
    trained `member` (the run folder whose config.json names it as --reward_model_dir)."""
    if pairs_path is None:
        for config_path in glob.glob(os.path.join("runs", "*", "config.json")):
            with open(config_path) as f:
                args = json.load(f).get("args") or {}  # a saved model's config.json has no args
            if os.path.normpath(args.get("reward_model_dir") or "") == os.path.normpath(member):
                pairs_path = os.path.join(os.path.dirname(config_path), "preferences", "test.jsonl")
        if pairs_path is None:
            raise SystemExit(f"error: no run in runs/ trained {member}; pass --pairs")
    rows = read_jsonl(pairs_path)
    return [(row["prompt_ids"] + row["chosen_ids"], row["prompt_ids"] + row["rejected_ids"]) for row in rows]


def report(ensemble, pairs_path=None, uwo_coefs=(1.0,)):
    members = ppo_rlhf._reward_model_members(ensemble)
    pairs = held_out_pairs(members[0], pairs_path)
    scores = [member_scores(path, pairs) for path in members]
    chosen, rejected = torch.stack([c for c, _ in scores]), torch.stack([r for _, r in scores])  # [K, N]
    prefers_chosen = chosen > rejected
    spread = torch.cat([chosen, rejected], 1).std(1)  # each member's score std over these responses [K]
    rows = [
        (os.path.basename(m), prefers_chosen[k].float().mean().item(), f"{spread[k]:.3f}")
        for k, m in enumerate(members)
    ]
    for combine, uwo_coef in [("mean", 0.0), ("wco", 0.0), *(("uwo", coef) for coef in uwo_coefs)]:
        c, r = (ppo_rlhf.ensemble_reward(x, combine, uwo_coef) for x in (chosen, rejected))
        name = f"ensemble: {combine}" + (f" (lambda {uwo_coef:g})" if combine == "uwo" else "")
        rows.append((name, (c > r).float().mean().item(), ""))
    pairwise, unanimous = agreement(prefers_chosen)
    variance = torch.cat([chosen, rejected], 1).var(0, unbiased=False)  # the members' disagreement on a response
    lines = [f"{len(members)} members of {ensemble}, {len(pairs)} held-out pairs", ""]
    lines += ["| model | pair accuracy | score std (centred scores of both responses) |", "| --- | --- | --- |"]
    lines += [f"| {name} | {accuracy:.3f} | {std} |" for name, accuracy, std in rows]
    lines += [
        "",
        f"Members agreeing on a pair: {pairwise:.3f} (two members, averaged), {unanimous:.3f} (all of them).",
        "The members' variance of a response's score (UWO's penalty at lambda 1), over the held-out responses: "
        + ", ".join(
            f"{name} {variance.quantile(q).item():.3f}" for name, q in (("median", 0.5), ("90th percentile", 0.9))
        )
        + f", max {variance.max().item():.3f}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ensemble", default="runs/reward_ensemble", help="a folder of reward models")
    parser.add_argument("--pairs", default=None, help="a preferences JSONL with prompt_ids, chosen_ids, rejected_ids")
    parser.add_argument("--uwo_coef", type=float, nargs="+", default=[1.0], help="lambda(s) of UWO, one row each")
    parser.add_argument("--out", default=None, help="write the table there (markdown)")
    args = parser.parse_args(argv)
    text = report(args.ensemble, args.pairs, args.uwo_coef)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
