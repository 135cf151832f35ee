"""Every SGLang private that sgl-loopkv depends on, in one table: the project's effective patches.

sgl-loopkv extends SGLang through its public extension points (plugin entry point, attention and
radix-cache registries, ``HookRegistry``, the KV pool's layer transfer counter). Where no public
method offers the behaviour, the code below overrides or calls a private method, reads a private
field, or relies on what a method does inside. Each such use is listed here with the SHA-256 of
the SGLang source it was written against (``inspect.getsource``); :func:`check` (run by
``tests/unit/test_sglang_privates.py``) fails loudly when an SGLang upgrade changes any of them, so the
use is re-read instead of silently forking SGLang. A field is pinned through the methods that
define and maintain it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass

RADIX = "sglang.srt.mem_cache.radix_cache"
POOL = "sglang.srt.mem_cache.memory_pool"
TOKENIZER = "sglang.srt.managers.tokenizer_manager"
HTTP = "sglang.srt.entrypoints.http_server"
GGUF = "sglang.srt.layers.quantization.gguf"


@dataclass(frozen=True, slots=True)
class PrivateUse:
    target: str  # "module:Qualified.name" of the SGLang function / method / property pinned
    sha256: str  # of inspect.getsource(target) in the pinned SGLang version
    use: str  # what sgl-loopkv does with it, and where


PRIVATES: tuple[PrivateUse, ...] = (
    PrivateUse(
        f"{RADIX}:RadixCache._split_node",
        "41cf62d34631ddfb4d7f2a316c2ccc7db39a40ad498947aee2c52a6f4bd1174e",
        "overridden (cache/radix.py): a node without a device copy is split too, and its stored extent with it",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache._delete_leaf",
        "87ffd8307996f475f787cf9ba41ec7791614aeb3e7cc268477fd44ed825dd708",
        "overridden (cache/radix.py): the per-leaf step of evict; a stored node keeps its place without a device copy",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache.evict",
        "6a21b4d769f2bf7b02d57b8580308db5062fec6de3f8a5bd8ad0992dfc10b84b",
        "relied on (cache/radix.py evict calls super): frees each leaf's slots, then calls _delete_leaf",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache._update_leaf_status",
        "51f24b8b31638db3fb73bf21b142c023f4af36c6698b24e056d493c8aec80f2d",
        "called (cache/radix.py, cache/node.py): keeps the private evictable_leaves set right when a node gains or "
        "loses slots",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache.insert",
        "707457e4ec8e992d50ce7c3100c5c5c49de83e614063dbeab1b6d59302ce941c",
        "relied on (cache/radix.py insert calls super): nodes given slots before it count as the matched prefix",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache._insert_helper",
        "6f65095a47591ef29e96fc1944a8b56423c998d4ef081b1b4450a11478a557a5",
        "relied on (through insert): walks matched nodes, splits, adds the unmatched tail as one new leaf",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache.match_prefix",
        "00cc574a4e0b9d172ea77110c61bbf8e13a6e777333a463a14c0dcbe54bf7204",
        "copied in part (cache/radix.py match_prefix): its key normalisation and _empty_match_result",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache.reset",
        "83715ea6648b5df79312918f6469a83be84a34ca569283c29e67bebfa7da9724",
        "fields read/written: evictable_size_, evictable_leaves, _empty_match_result, root_node",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache.inc_lock_ref",
        "ef3f21db134815b32bed476092fe221f87d7f299d462f15de051fc543ae1bfb6",
        "field evictable_size_: what it counts (unlocked device tokens) when cache/radix.py adjusts it",
    ),
    PrivateUse(
        f"{RADIX}:RadixCache.dec_lock_ref",
        "27c044fb8f7fc81998c0ae5ced7dafa849a9ca95b43fdd1ba1f0a3de1893d363",
        "field evictable_size_: as inc_lock_ref",
    ),
    PrivateUse(
        f"{RADIX}:TreeNode.evicted",
        "616ac47e3e3b38db7862791d5e9fd9439da4b27d8dda524c7266c65933fb02dc",
        "relied on: a node without a device copy is one whose value is None",
    ),
    PrivateUse(
        "sglang.srt.managers.scheduler:Scheduler.process_batch_result",
        "726305f46a979a47a7bc334d9d8b98122943adf36da5a977ce2292c21ff7a8e2",
        "relied on (cache/radix.py flush_pending_backups): called once per batch, after the result processor "
        "has streamed the batch's outputs; a finished turn is stored to the tiers there, not before its last token",
    ),
    PrivateUse(
        "sglang.srt.mem_cache.allocation:alloc_for_extend",
        "79929fe4dbc6fcec6b21939c16d13bca32575f02c0db6bc986fbd2f2bd47f6e2",
        "relied on (cache/radix.py maybe_hand_to_session): called for every request of an extend batch once its "
        "row was written with prefix_device_indices' indices; a chunk-pruned restore is adopted there",
    ),
    PrivateUse(
        "sglang.srt.managers.scheduler:Scheduler.get_new_batch_prefill",
        "a8b9a7a4fee3e50eea30094ab73dfcc4c840c8398c1d4d8cc5b231849d2980ee",
        "AROUND hook (cache/awaited.py): called with running_batch, returns a NextBatchPlan (batch_to_run, "
        "running_batch); fields waiting_queue (a list of Req, replaced for the call) and tree_cache read",
    ),
    PrivateUse(
        "sglang.srt.managers.scheduler:Scheduler._get_new_batch_prefill_raw",
        "09e8cf03a4d0c1bb2eaeed359d929a07c7df0c44281849b92ed2cba922402eec",
        "relied on (cache/awaited.py): admits requests from self.waiting_queue only, and leaves there (a new list) "
        "the ones it did not admit",
    ),
    PrivateUse(
        "sglang.srt.managers.schedule_batch:Req.init_next_round_input",
        "e7af52023f823aec3726cf67236ed435b6cf8e585376f3032bcb636bf73372fb",
        "called with the tree cache (cache/discovery.py awaits_write): matches the request as the scheduler does "
        "before admitting it (match_prefix with req=self)",
    ),
    PrivateUse(
        f"{POOL}:MHATokenToKVPool.get_key_buffer",
        "ab5fc2d68e854c1d8c0f34ae5d0ed0d79072df1d95b06ca56198a542046c9919",
        "relied on (cache/loader.py): waits on the registered layer transfer counter before handing out a layer",
    ),
    PrivateUse(
        f"{POOL}:MHATokenToKVPool.get_value_buffer",
        "ba5ea7b1b294d656e697ec4ae094a5356271e6735c361d0bc2ede17dcf227d54",
        "relied on (cache/loader.py): as get_key_buffer",
    ),
    PrivateUse(
        "sglang.srt.managers.scheduler_components.output_streamer:SchedulerOutputStreamer.get_cached_tokens_details",
        "532f8103ebb758996a2682345a6bc131ce1c0dff4c861004ce831bbadce4138b",
        "wrapped by an AROUND hook (cache/backend.py): its signature and the dict it returns",
    ),
    PrivateUse(
        f"{TOKENIZER}:TokenizerManager.generate_request",
        "894e0b7b045095200ca7ab30150bdcc7ef605c759d5d487d95427c473cf61f0a",
        "BEFORE hook (server/limits.py): gets the request before it normalizes it; a ValueError becomes a 400",
    ),
    PrivateUse(
        "sglang.srt.managers.io_struct:GenerateReqInput._handle_parallel_sampling",
        "26012f2f89c73df3ea3f02e77f737b7410f6c069053f148a5b77f656ea574e83",
        "relied on (server/limits.py): n is read from the un-normalized sampling params, a dict or a list",
    ),
    PrivateUse(
        "sglang.srt.entrypoints.openai.protocol:ChatCompletionRequest.to_sampling_params",
        "f79de67850d933533731cdd8d41a00033476c4eb8163cfc1d11e13554fb21d76",
        "relied on (server/limits.py): max_new_tokens None means the client set no max_tokens",
    ),
    PrivateUse(
        f"{TOKENIZER}:TokenizerManager.sigterm_watchdog",
        "a7c8325071b2137783a428e579165d9c19a55d9d94fdd54cd86b69bdb531fc6b",
        "AROUND hook (server/limits.py): waits for gracefully_exit, then until rid_to_state is empty; fields "
        "gracefully_exit, rid_to_state, asyncio_tasks read",
    ),
    PrivateUse(
        f"{TOKENIZER}:TokenizerManager.abort_request",
        "f4822939e280a0aaffc00ac74cc2d510b701478ec75b1bb2eae473efd9435b7a",
        "called with abort_all=True (server/limits.py) once the shutdown grace period is over",
    ),
    PrivateUse(
        f"{TOKENIZER}:TokenizerManager._validate_one_request",
        "913d991d70106bffabf71c04915609bc6cc8b15678478eb5aae2c10b9ef814d8",
        "AFTER hook (server/request_checks.py): called once per normalized request with its token ids "
        "(obj.top_logprobs_num an int, obj.return_logprob a bool); a ValueError becomes a 400; field "
        "model_config.vocab_size read",
    ),
    PrivateUse(
        "sglang.srt.layers.logprob_processor:get_top_logprobs_raw",
        "d7d2983acb90152f5762f01672a0be56b99e031b01c2308561f042c9cb089c5c",
        "relied on (server/request_checks.py): topk(max top_logprobs_num) over the vocabulary, whose error ends the "
        "scheduler: the reason top_logprobs_num past the vocabulary is rejected",
    ),
    PrivateUse(
        "sglang.srt.layers.quantization.unquant:UnquantizedEmbeddingMethod.embedding",
        "247e6955347819f9f45fc88b73ae1d596a83dff0b3998fd30556fe5274c27906",
        "relied on (server/request_checks.py): F.embedding without a range check, whose IndexError ends the "
        "scheduler: the reason input token ids outside the vocabulary are rejected",
    ),
    PrivateUse(
        "sglang.srt.entrypoints.openai.serving_tokenize:OpenAIServingDetokenize._validate_request",
        "ef8afbe6f1d6d983e59795700921d82dfcf9c1e38fb8e536fe780fac899abb44",
        "AFTER hook (server/request_checks.py): OpenAIServingBase's (a no-op) until the class defines its own; "
        "returns an error message or None",
    ),
    PrivateUse(
        "sglang.srt.entrypoints.openai.serving_base:OpenAIServingBase.handle_request",
        "f47d3e8fad409f773a3c8cfc48246b8cbd00825b89ffe333796649065282ee62",
        "relied on (server/request_checks.py): a message from _validate_request is answered 400 before the "
        "handler runs",
    ),
    PrivateUse(
        "sglang.srt.entrypoints.openai.serving_tokenize:OpenAIServingDetokenize._handle_non_streaming_request",
        "ea72b3218b38736dc987ec8618659e7a7505af8d8b8012f1cc56bf7f182ce003",
        "relied on (server/request_checks.py): answers the tokenizer's OverflowError (an id < 0 or >= 2^32) with "
        "a 500: the reason detokenize ids outside the vocabulary are rejected first",
    ),
    PrivateUse(
        "sglang.srt.managers.io_struct:EmbeddingReqInput.normalize_batch_and_arguments",
        "55ad67ffc0dd68de63ba9a298314929ab7df571639e28697bc87e8d7ce88434f",
        "AROUND hook (server/request_checks.py): reads only the request's fields (so what it raises is bad "
        "input); fields is_single, batch_size, rid, sampling_params read after it",
    ),
    PrivateUse(
        "sglang.srt.managers.io_struct:EmbeddingReqInput.__getitem__",
        "cfadce9d8e664a5947ae43e2aa6d3574137f4998d453a9beb9571ce5fe678ddb",
        "relied on (server/request_checks.py): indexes rid and sampling_params per request without a length check",
    ),
    PrivateUse(
        f"{HTTP}:launch_server",
        "92fe88cd0c030d93296678d5a52ff7103e23e51c5612ce8c9dabf07e9888604c",
        "AROUND hook (server/errors.py): runs in the launcher before uvicorn serves the module's app, so middleware "
        "and exception handlers added to app then are in effect",
    ),
    PrivateUse(
        f"{HTTP}:validation_exception_handler",
        "0f73a3d642f94d75da75789e2a76424c8774f6f5f2b3d5a412a4fb9978f0f2d6",
        "wrapped (server/errors.py): its message is str(exc) (FastAPI's text: endpoint file and line) plus "
        "str(exc.errors()); the wrapper hands it the errors without the endpoint context",
    ),
    PrivateUse(
        f"{HTTP}:lifespan",
        "e2bebaf891d920176750d8f0bab701d6959c5ecb4c31376e6169067194aa3341",
        "relied on (server/errors.py): app.state.openai_serving_responses is set only when the Responses API "
        "started; without it its routes fail with a 500, so they are answered 404",
    ),
    PrivateUse(
        "sglang.srt.layers.logits_processor:LogitsProcessor._compute_lm_head",
        "c5062fc225cae30ddc3c553a12d789006594a0975b0e48d65a16132ddb6f1f00",
        "AROUND hook (models/decode_linear.py): takes over its plain-weight branch (hidden @ weight.T) for few "
        "CPU rows; repeats its conditions (LoRA, quant method, fp32 head, AMX, rl_on_policy_target)",
    ),
    PrivateUse(
        "sglang.srt.layers.quantization.unquant:UnquantizedLinearMethod.apply",
        "0c43ec585f40ba2e793f23bd01b28fa11faa95da7de3b9a8d1cd99dc1ebd1de5",
        "AROUND hook (models/decode_linear.py): relies on its CPU path being F.linear unless the layer uses AMX",
    ),
    PrivateUse(
        "sglang.srt.server_args:prepare_server_args",
        "6c062dd465d2d14593d9e4a359e77eaa9282da0ef6a06bfabee267e75165d835",
        "field _launch_command (set here, the argv joined) overwritten by the launcher (server/redact.py): "
        "GET /server_info shows it, --api-key/--admin-api-key values included",
    ),
    PrivateUse(
        "sglang.srt.server_args:ServerArgs.launch_command",
        "343cfeb908ac4427e52476e896f17255dd9f4ab1b3c9c152f17ff457d0dc1ac1",
        "read (server/redact.py): returns _launch_command",
    ),
    PrivateUse(
        "sglang.srt.models.llama:LlamaModel.forward",
        "d02b894a8afcbf3f4945a3bf062bbe297cd8d8c96cfaef66d5415db1e87d981b",
        "AROUND hook (models/lean_forward.py): a decode or extend batch runs the same layers in a plain loop; relies on "
        "the layers' residual stream being h = norm(x + residual) and on the final norm's output being returned",
    ),
    PrivateUse(
        "sglang.srt.models.llama:LlamaDecoderLayer.forward",
        "6d3680dbd7256ed245ecc69eddd62d9ab58ed482626175dfa1d327eeb1876606",
        "repeated (models/lean_forward.py): input norm, attention, post-attention norm, MLP",
    ),
    PrivateUse(
        "sglang.srt.models.llama:LlamaAttention.forward",
        "232b19ff50081952b7cc1893b5333b1864b0bf210ff13adb75031199261ac45e",
        "repeated (models/lean_forward.py): qkv projection, rotary embedding, RadixAttention, o projection",
    ),
    PrivateUse(
        "sglang.srt.models.llama:LlamaAttention.forward_prepare_native",
        "eb09e68f522b40b5996c6035bdf576eec8473553cf59b63dea1e31368e4a1f0c",
        "repeated (models/lean_forward.py): the q/k/v split of the qkv projection",
    ),
    PrivateUse(
        "sglang.srt.models.llama:LlamaMLP.forward",
        "0ad4e3f4819bb3def72d07d0cb4eba42ab75aa50a5c3546730eb93ba0edcf491",
        "repeated (models/lean_forward.py): gate_up, act_fn (activation_quant disabled, no dual GEMM), down",
    ),
    PrivateUse(
        "sglang.srt.layers.rotary_embedding.base:RotaryEmbedding.__init__",
        "669e515f7f234f9188f01062fe2722ac1d5a597e610b8893ac8ad07543e27e1a",
        "field _apply_rotary_emb_wrapped read (models/lean_forward.py): apply_rotary_emb itself unless compiled",
    ),
    PrivateUse(
        "sglang.srt.layers.rotary_embedding.base:RotaryEmbedding.forward_native",
        "2e5d856d6d4a395b28c24e6297cfa62e4a1a34f8e41660534f80f857ff769d12",
        "repeated (models/lean_forward.py): cos/sin from cos_sin_cache by position, the rotary part rotated",
    ),
    PrivateUse(
        "sglang.srt.layers.rotary_embedding.base:RotaryEmbedding.forward_cpu",
        "07ad42b13b4be4f2854c0182786040f4d3a21974a0c440921eb67b6e68d2bf5d",
        "relied on (models/lean_forward.py): forward_native unless the CPU has AMX",
    ),
    PrivateUse(
        "sglang.srt.layers.rotary_embedding.utils:apply_rotary_emb",
        "14486971b6c3ee7300367588623204e8616fc53bdd82dbaf1480907a985c94b0",
        "repeated element for element (models/lean_forward.py _rotate), neox style",
    ),
    PrivateUse(
        f"{GGUF}:GGUFLinearMethod._create_padded_weight_param",
        "3c3a366ba54e86d4e165ecca2ad08e77407bcf0df410a21c7fb7e91d82fdeeaa",
        "read (models/gguf/weights.py _loaded_blocks): a merged layer's shards padded into qweight, shard_offset_map",
    ),
    PrivateUse(
        f"{GGUF}:GGUFLinearMethod.apply",
        "bff73dd185842da37cc8b69ad787eea2c88968b60c5e8146a6fb618aa87f49b4",
        "hooked (models/decode_linear.py gguf_linear_apply): replaced for layers served from blocks",
    ),
    PrivateUse(
        f"{GGUF}:GGUFEmbeddingMethod.embedding",
        "ea294f6bce2c86d03e0e750f8ccf455c80448701848b6d9ed442559ba7929e60",
        "hooked (models/decode_linear.py embedding): replaced for layers served from blocks (params_dtype read)",
    ),
    PrivateUse(
        "sglang.srt.utils.hf_transformers.tokenizer:_load_tokenizer_by_declared_class",
        "e6d4d25af99d893f575eaf4a5d26bc097c25f2ab85a1f77567fbe03d7d130fa4",
        "worked around (models/gguf/serving.py tokenizer_folder): fails on a .gguf path (a Path looked up on the Hub)",
    ),
)


def resolve(target: str):
    """The function behind ``"module:Qualified.name"`` (a property's getter)."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return obj


def source_hash(obj) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def check(privates: tuple[PrivateUse, ...] = PRIVATES) -> list[str]:
    """One line per pinned SGLang source that changed (empty: all as pinned)."""
    changed = []
    for p in privates:
        try:
            h = source_hash(resolve(p.target))
        except (ImportError, AttributeError, OSError, TypeError) as e:
            changed.append(f"{p.target}: gone ({e}); it was {p.use}")
            continue
        if h != p.sha256:
            changed.append(f"{p.target}: source changed (sha256 {h}); re-read: {p.use}")
    return changed
