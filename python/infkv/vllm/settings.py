"""Per-request settings of infkv's vLLM plugin: from a request's `SamplingParams.extra_args` (the
OpenAI body's `vllm_xargs`), else the server's defaults (environment), checked with errors that
name the field."""
from __future__ import annotations

import os
from dataclasses import dataclass

import infkv

# Policies a request may name, with the window queries they read (0: none).
POLICIES = {
    "streaming_llm": lambda w: infkv.streaming_llm(),
    "keydiff": lambda w: infkv.keydiff(),
    "tova": lambda w: infkv.tova(),
    "snapkv": lambda w: infkv.snapkv(window=w),
    "inf_mllm": lambda w: infkv.inf_mllm(window=w),
    "inf_mllm_bias": lambda w: infkv.inf_mllm(window=w, bias=infkv.attention_bias(beta=0.5)),
}
QUERY_POLICIES = {"snapkv", "inf_mllm", "inf_mllm_bias"}
FIELDS = ("infkv_policy", "infkv_budget", "infkv_sinks", "infkv_block", "infkv_window")


@dataclass(frozen=True)
class Settings:
    policy: str = "none"  # "none": the request is not evicted
    budget: int = 1024  # slots kept after an eviction
    sinks: int = 4  # first slots always kept
    block: int = 128  # decode slots between two evictions (at most budget + block, or + one prefill chunk)
    window: int = 32  # window queries for the policies that read them

    @property
    def evicts(self) -> bool:
        return self.policy != "none"

    def make_policy(self):
        return POLICIES[self.policy](self.window)

    def budget_value(self):
        recent = self.window if self.policy in QUERY_POLICIES else 0
        return infkv.budget(capacity=self.budget, sinks=self.sinks, recent=recent)


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"infkv: {name} = {value!r}: must be an integer >= {low}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"infkv: {name} = {value!r}: must be an integer >= {low}") from None
    if number != float(value) or number < low:
        raise ValueError(f"infkv: {name} = {value!r}: must be an integer >= {low}")
    return number


def defaults() -> dict:
    """The server's defaults: INFKV_VLLM_POLICY, INFKV_VLLM_BUDGET, ... (as the request fields)."""
    out = {}
    for field in FIELDS:
        env = "INFKV_VLLM_" + field[len("infkv_"):].upper()
        if os.environ.get(env):
            out[field] = os.environ[env]
    return out


def parse(extra_args: dict | None) -> Settings:
    """A request's settings: its extra_args' infkv_* fields over the server's defaults. Raises
    ValueError naming the field for an unknown field, policy or a bad number."""
    given = dict(defaults())
    for key, value in (extra_args or {}).items():
        if key.startswith("infkv_"):
            if key not in FIELDS:
                raise ValueError(f"infkv: {key} = {value!r}: unknown field (known: {', '.join(FIELDS)})")
            given[key] = value
    policy = str(given.get("infkv_policy", "none"))
    if policy != "none" and policy not in POLICIES:
        raise ValueError(f"infkv: infkv_policy = {policy!r}: must be 'none' or one of {', '.join(POLICIES)}")
    s = Settings(
        policy=policy,
        budget=_int("infkv_budget", given.get("infkv_budget", 1024), 1),
        sinks=_int("infkv_sinks", given.get("infkv_sinks", 4), 0),
        block=_int("infkv_block", given.get("infkv_block", 128), 1),
        window=_int("infkv_window", given.get("infkv_window", 32), 1),
    )
    if s.evicts:
        protected = s.sinks + (s.window if policy in QUERY_POLICIES else 0)
        if s.budget < protected:
            raise ValueError(f"infkv: infkv_budget = {s.budget}: must hold the protected slots "
                             f"(infkv_sinks {s.sinks}" + (f" + infkv_window {s.window}" if policy in QUERY_POLICIES
                                                          else "") + ")")
        s.budget_value()  # and infkv checks the rest
    return s
