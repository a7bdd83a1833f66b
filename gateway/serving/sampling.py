"""A request body's sampling options as the engines' SamplingParams: one choice at a
time (its seed offset by its index), with the structured output a forced tool call or
the body asks for. Shared by admission and a worker's own /v1/completions.

An option the body leaves out takes the model's default where its card has one
(ModelCard.sampling_defaults: its generation_config, as vLLM does), else the API's.

Special tokens stay in the text where the backend's output parsers read markers that
are special tokens in their families' vocabularies (Mistral's [TOOL_CALLS], Llama's
<|python_tag|>, gpt-oss's channels, a template's <tool_call> where it is one): with a
tool parser and tools offered, or harmony's reasoning parser (vLLM's parsers ask the
same of the request, `adjust_request`).
"""

from __future__ import annotations

from collections.abc import Mapping

from engine_api.records import GenRequest
from engine_api.sampling import SamplingParams
from engine_api.structured import StructuredOutput
from gateway.schemas.inference import ChatCompletionRequest, CompletionRequest
from gateway.serving.parser_choice import Parsers
from gateway.serving.tool_calls import ToolPlan, think_first


def structured_output(
    body: ChatCompletionRequest | CompletionRequest, reasoning: str | None = None
) -> StructuredOutput | None:
    """What the output must match: a forced tool call's schema, or the body's own
    structured output (the schema refuses both at once); on a chat, after the reasoning
    its model's family writes first (`reasoning`: the backend's reasoning parser), where
    thinking is on."""
    if not isinstance(body, ChatCompletionRequest):
        return body.structured()
    out = ToolPlan.of(body).constraint() if body.forced_tools else body.structured()
    if out is not None:
        out.reasoning = think_first(reasoning, body.thinking)
    return out


def sampling(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    choice: int,
    structured: StructuredOutput | None,
    defaults: Mapping[str, float] | None = None,
) -> SamplingParams:
    """The body's sampling options for one choice (its seed offset by the choice's index);
    `structured` is structured_output(body), made once for all the choices; `defaults`
    the model's, for the options the body leaves out."""
    # the model's defaults for what the body left out (generation_config keeps top_k an int)
    model = {k: v for k, v in (defaults or {}).items() if k not in body.model_fields_set}
    return SamplingParams(
        temperature=model.get("temperature", body.temperature),
        top_p=model.get("top_p", body.top_p),
        top_k=model.get("top_k", body.top_k),
        min_p=model.get("min_p", body.min_p),
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=body.stop or [],
        stop_token_ids=body.stop_token_ids or [],
        seed=None if body.seed is None else body.seed + choice,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=model.get("repetition_penalty", body.repetition_penalty),
        logprobs=body.num_logprobs,
        prompt_logprobs=body.num_prompt_logprobs,
        logit_bias=body.token_bias(),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        structured=structured,
    )


def keep_markers(
    requests: list[GenRequest],
    parsers: Parsers,
    body: ChatCompletionRequest | CompletionRequest,
) -> list[GenRequest]:
    """`requests` keeping special tokens in their text where `parsers` read markers
    that may be special tokens; as they are otherwise. Changed in place (each has its
    own SamplingParams, made for it by `sampling`): copying two dataclasses a choice
    showed in the gateway's profile under the parsers' load (docs/PERF.md, issue 48)."""
    offered = isinstance(body, ChatCompletionRequest) and body.tool_mode == "auto"
    if parsers.reasoning == "openai" or (parsers.tools and offered):
        for r in requests:
            r.sampling.skip_special_tokens = False
    return requests
