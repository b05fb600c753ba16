"""Recommendation models: DLRMv3 (HSTU over jagged user histories) and its tables.

  config   `HSTUConfig`, presets ("tiny_hstu", "dlrm_v3"), the param declaration
  batch    users packed into one token axis with offsets (`pack`, `validate`)
  hstu     the HSTU trunk and candidate head over packed tokens (`score`)
  tables   lookups, bag pooling, int8 / fp8 rows, row- and table-wise sharding, hot rows
  metrics  NE, AUC, accuracy and MLPerf's targets
  synthetic the streaming synthetic data set of the benchmark's shape
  memory   memory plans on H100s compiled from abstract params (`recsys.memory`)
"""

from jaxinfer.recsys import batch, config, hstu, metrics, synthetic, tables
from jaxinfer.recsys.batch import JaggedBatch, User, pack
from jaxinfer.recsys.config import HSTUConfig
