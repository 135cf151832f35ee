"""SGLang glue: the ``loopkv`` radix-cache factory (``register_radix_cache_backend``) and the
per-tier ``cached_tokens_details`` it reports in ``meta_info``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from sgl_loopkv.cache.cipher import SegmentCipher
from sgl_loopkv.cache.disk_dir import DirectoryLock, bounded_quota
from sgl_loopkv.cache.layout import KVGeometry
from sgl_loopkv.cache.retention import RetentionBook
from sgl_loopkv.cache.store import TieredKVStore
from sgl_loopkv.cache.value import VALUE_POLICIES
from sgl_loopkv.config import LoopKVConfig
from sgl_loopkv.context import get_context, has_context

logger = logging.getLogger(__name__)

BACKEND_NAME = "loopkv"


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(model_path: str, geometry: KVGeometry) -> str:
    """Disk subdirectory per model and KV geometry: stored KV is only valid for the exact weights.
    Weights replaced in place (same folder and config) change it too: the weight files' names,
    sizes and modification times are part of it (hashing their bytes would read gigabytes at start-up);
    for a model path that is a file (GGUF), the file's."""
    root = Path(model_path)
    config = root / "config.json"
    weights = []
    for f in sorted(root.iterdir()) if root.is_dir() else [root]:  # a GGUF file: the file itself
        if f.name.endswith(WEIGHT_SUFFIXES) and f.exists():  # exists(): not a dangling link
            st = f.stat()  # through links: a hub snapshot links to its blobs
            weights.append([f.name, st.st_size, st.st_mtime_ns])
    ident = [os.path.realpath(model_path), config.read_text() if config.exists() else "", geometry.to_json(), weights]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def create_loopkv_radix_cache(ctx):
    """Factory for ``--radix-cache-backend loopkv`` (a TreeCacheBuildContext in, a cache out)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    from sgl_loopkv.cache.radix import LoopKVRadixCache
    from sgl_loopkv.cache.sharing import LayerSharing

    if ctx.disable_radix_cache:
        return default_radix_cache_factory(ctx)
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.params.is_eagle:
        raise ValueError("--radix-cache-backend loopkv supports full-attention models without speculative decoding")
    config = LoopKVConfig.from_env()
    tiers, sharing = config.tiers, config.sharing
    kv_pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    key_file = config.lifecycle.disk_key_file
    cipher = SegmentCipher.from_file(key_file) if key_file and tiers.disk_path is not None else None

    def store_factory(geometry, on_lost):
        disk_dir, lock, quota = None, None, 0
        if tiers.disk_path is not None:
            disk_dir = tiers.disk_path / model_fingerprint(ctx.server_args.model_path, geometry)
            if cipher is not None:  # one directory per key: another key's files are never looked up, nor plain ones
                disk_dir = disk_dir.with_name(f"{disk_dir.name}-key-{cipher.key_id}")
            lock = DirectoryLock(disk_dir)  # shared with other workers; before anything reads or cleans it
            quota = bounded_quota(disk_dir, tiers.disk_bytes, tiers.disk_free_share)
            if quota < tiers.disk_bytes:
                logger.warning(
                    "loopkv: disk tier quota %.2f GB (--loopkv-tier-disk-bytes %.2f GB is over %.0f%% of the free "
                    "space)",
                    quota / 1e9,
                    tiers.disk_bytes / 1e9,
                    100 * tiers.disk_free_share,
                )
        return TieredKVStore(
            geometry,
            VALUE_POLICIES.create(tiers.value_policy),
            host_quota_bytes=tiers.host_bytes,
            disk_dir=disk_dir,
            disk_quota_bytes=quota,
            on_lost=on_lost,
            dir_lock=lock,
            layer_group=config.prefix.file_layer_group,  # a pruned restore reads a period's layers together
            read_ahead=tiers.disk_read == "background",
            disk_ttl_s=config.lifecycle.disk_ttl_s,
            retention=RetentionBook(
                config.lifecycle.pin_bytes, config.lifecycle.tenant_host_share, config.lifecycle.tenant_disk_share
            ),
            disk_cipher=cipher,
        )

    from sgl_loopkv import restore
    from sgl_loopkv.restore.restorer import Restorer

    shared = get_context()
    planner = restore.PLANNERS.create(config.restore.planner, config.restore)

    def layer_stack():  # the model's layers for partial recompute: only with the loopkv attention backend
        return shared.layer_stack() if shared.layer_stack is not None else None

    cache = LoopKVRadixCache(
        ctx.params,
        kv_pool=kv_pool,
        store_factory=store_factory,
        restorer=Restorer(planner, stack=layer_stack, calibrate_on_first_use=planner.needs_cost_model),
        importance=shared.importance,
        store_dtype=None if tiers.store_dtype == "pool" else getattr(torch, tiers.store_dtype),
        prefix=config.prefix,
        sharing=(
            LayerSharing(sharing.layers, sharing.gamma, sharing.ratio, sharing.pairing, shared.observer)
            if sharing.enabled
            else None
        ),
    )
    shared.cache = cache
    logger.info(
        "loopkv radix cache: chunk %d tokens, host quota %.2f GB, disk %s (quota %.2f GB), value policy %s",
        ctx.params.page_size,
        tiers.host_bytes / 1e9,
        tiers.disk_path or "off",
        cache.store.disk.quota_bytes / 1e9 if cache.store.disk is not None else 0.0,  # as bounded by free space
        tiers.value_policy,
    )
    return cache


CACHED_TOKENS_DETAILS_TARGET = (
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.get_cached_tokens_details"
)


def cached_tokens_details(original, self, req, *args, **kwargs):
    """AROUND hook: report cached tokens by the tier they were loaded from ("storage" = disk,
    SGLang's name for its L3 tier), since to SGLang every loaded token looks like a device hit."""
    cache = get_context().cache if has_context() else None
    if cache is None:
        return original(self, req, *args, **kwargs)
    # Also with nothing cached (SGLang says None then): behind a router, which worker served a
    # request is worth knowing for every request.
    tiers = cache.tier_breakdown(req.rid, max(req.cached_tokens, 0))
    return {
        "device": tiers["device"],
        "host": tiers["host"],
        "storage": tiers["disk"],
        "storage_backend": "loopkv-disk",
        "storage_shared": tiers["shared"],  # of "storage": stored by another worker of the cluster
        "worker": cache.worker_id,  # which worker served it (opaque), for clients and benchmarks behind a router
        **({"pin": tiers["pin"]} if "pin" in tiers else {}),  # a pin hint's outcome (cache.retention)
        **({"pruned": tiers["pruned"]} if "pruned" in tiers else {}),  # a chunk-pruned restore's reads
    }
