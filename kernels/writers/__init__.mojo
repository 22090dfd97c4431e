"""The k-pool writers: `ring_close`, `compress`, `seed_tail` and
`expand_topk` under MAX's op names, the fused `mla_kpool.step`, and the
per-channel pooling routine (`pooling`) the pooling writers share.
"""
