"""`index_top_k`'s GPU path: the plan, score and select launches
(`index_gpu`), the FP32 scorer (`index_gpu_score`, `index_gpu_shape`), the
tensor-core scorers (`index_wgmma`, `index_mfma`) with the host models of
their instructions (`wgmma_model`, `mfma_model`), and the select
(`index_select`).
"""
