"""Request values that SGLang 0.5.23 accepts but that kill its scheduler: rejected with a 400 first.

Found by ``benchmarks/studies/fuzz.py``; each ends the scheduler process, i.e. the whole server, for every
client:

- ``top_logprobs_num`` (``top_logprobs`` of the OpenAI APIs) past the vocabulary reaches
  ``torch.topk`` in the sampler (``RuntimeError``);
- an input token id outside the vocabulary (``input_ids`` of ``/generate``, a token-id ``prompt``
  of ``/v1/completions``) reaches the embedding lookup (``IndexError``);
- a prompt of no tokens (``"text": ""``; SGLang rejects only an empty ``input_ids``) reaches the
  rotary embedding as an empty batch (``RuntimeError``).

And some that are answered 500 without harm to the server:

- ``/v1/detokenize`` of a negative or huge token id (the tokenizer's ``OverflowError``, which
  SGLang's handler reports as an internal error). An AFTER hook on
  ``OpenAIServingDetokenize._validate_request``, SGLang's validation step of the OpenAI handlers (a
  message there is a 400), checks the ids first.
- a batch embedding/classify request (``/encode``, ``/classify``, ``/v1/classify``) whose ``rid`` or
  ``sampling_params`` list does not match the batch (``IndexError``, ``AssertionError`` in
  ``EmbeddingReqInput``, which unlike ``GenerateReqInput`` does not check them). An AROUND hook on
  its ``normalize_batch_and_arguments`` turns those into ``ValueError`` and checks the lengths.

An AFTER hook (SGLang's ``HookRegistry``) on ``TokenizerManager._validate_one_request``, where
SGLang checks each normalized request against the model (context length, ``token_ids_logprob``),
raises ``ValueError`` there, which SGLang answers with a 400. Only in servers started by sgl-loopkv's launcher.
"""

from __future__ import annotations

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
EMBED_NORMALIZE_TARGET = "sglang.srt.managers.io_struct.EmbeddingReqInput.normalize_batch_and_arguments"
DETOKENIZE_TARGET = "sglang.srt.entrypoints.openai.serving_tokenize.OpenAIServingDetokenize._validate_request"


def check_top_logprobs(return_logprob: bool, top_logprobs_num, vocab_size: int) -> None:
    """Raise ``ValueError`` unless a logprob request's ``top_logprobs_num`` is in [0, vocab_size]."""
    if return_logprob and isinstance(top_logprobs_num, int) and not 0 <= top_logprobs_num <= vocab_size:
        raise ValueError(
            f"top_logprobs / top_logprobs_num must be in [0, {vocab_size}] (the vocabulary size), "
            f"got {top_logprobs_num}"
        )


def check_input_ids(input_ids, vocab_size: int, allow_empty: bool = False) -> None:
    """Raise ``ValueError`` unless every token id is an int in [0, vocab_size) and, unless
    ``allow_empty``, there is at least one (``None``: the request brings embeddings, not ids)."""
    if input_ids is None or (not len(input_ids) and allow_empty):
        return
    if not len(input_ids):
        raise ValueError("the prompt is empty: it has no tokens")
    try:
        lo, hi = min(input_ids), max(input_ids)
    except TypeError:  # ids of mixed types
        lo = hi = None
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo and hi < vocab_size):
        raise ValueError(f"input token ids must be integers in [0, {vocab_size}) (the vocabulary), got {lo}..{hi}")


def check_request_values(result, self, obj, input_ids, *args, **kwargs):
    """AFTER hook on ``TokenizerManager._validate_one_request(obj, input_ids)``: ``obj`` is one
    normalized request (a batch is validated one request at a time), ``input_ids`` its token ids."""
    vocab_size = self.model_config.vocab_size
    # a session's next turn may add no tokens of its own
    check_input_ids(input_ids, vocab_size, allow_empty=bool(getattr(obj, "session_params", None)))
    if hasattr(obj, "top_logprobs_num"):  # GenerateReqInput, not an embedding request
        check_top_logprobs(obj.return_logprob, obj.top_logprobs_num, vocab_size)
    return None


def check_detokenize_request(result, self, request, *args, **kwargs):
    """AFTER hook on ``OpenAIServingDetokenize._validate_request``: an error message (a 400) unless
    ``request.tokens`` (ids, or lists of ids) are all in the vocabulary."""
    if result:  # SGLang already rejects it
        return None
    tokens = request.tokens
    rows = tokens if tokens and isinstance(tokens[0], list) else [tokens]
    try:
        for row in rows:
            if not isinstance(row, list):  # a mix of ids and lists: SGLang's own check answers it
                continue
            check_input_ids(row, self.tokenizer_manager.model_config.vocab_size, allow_empty=True)
    except ValueError as e:
        return str(e)
    return None


def check_batch_lengths(obj) -> None:
    """Raise ``ValueError`` where a normalized batch request's per-request lists do not match it."""
    if obj.is_single:
        return
    for name in ("rid", "sampling_params"):
        value = getattr(obj, name)
        if isinstance(value, list) and len(value) != obj.batch_size:
            raise ValueError(f"{name} has {len(value)} entries but the batch has {obj.batch_size} requests")


def normalize_embedding_request(original, self, *args, **kwargs):
    """AROUND hook on ``EmbeddingReqInput.normalize_batch_and_arguments``: it only reads the
    request's own fields, so what it raises is the request's fault (a ``ValueError``: a 400)."""
    try:
        result = original(self, *args, **kwargs)
    except (AssertionError, IndexError, KeyError, TypeError) as e:
        raise ValueError(f"the request's fields do not fit together: {e or type(e).__name__}") from e
    check_batch_lengths(self)
    return result
