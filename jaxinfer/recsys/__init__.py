"""Recommendation models: DLRMv3 (HSTU over jagged user histories) and its tables.

  config   `HSTUConfig`, presets ("tiny_hstu", "dlrm_v3"), the param declaration
  batch    users packed into one token axis with offsets (`pack`, `validate`)
  hstu     the HSTU trunk and candidate head over packed tokens (`score`)
  tables   lookups, bag pooling, int8 / fp8 rows, row- and table-wise sharding
"""

from jaxinfer.recsys import batch, config, hstu, tables
from jaxinfer.recsys.batch import JaggedBatch, User, pack
from jaxinfer.recsys.config import HSTUConfig
