"""Recommendation models: MLPerf v6.0's DLRMv3 as its reference runs it, the
paper-era HSTU as a variant, their tables, data, metrics and memory plans.

  family        the two models behind one interface; every preset (`get`)
  dlrm_config   `DlrmV3Config` (presets "dlrm_v3", "tiny_dlrm_v3"), its param declaration
  dlrm_state    the reference's state-dict names (`from_reference_state`)
  dlrm_checkpoint the reference's checkpoint layout read (`read_reference_checkpoint`)
  request       `DlrmRequest`: one user's history and candidates, as the reference reads them
  dlrm_batch    requests packed on one token axis with offsets (`pack`)
  stu           the STU layer and stack over packed tokens
  dlrm_v3       DlrmHSTU: preprocessor, STU stack, postprocessor, item tower, head (`score`)
  streaming     MLPerf's streaming synthetic data set files, read as its reference does
  synthetic_requests requests drawn from the reference generator's distributions
  config / batch / hstu / synthetic  the paper-era HSTU ("tiny_hstu", "hstu_paper")
  tables        lookups, bag pooling, int8 / fp8 rows, row- and table-wise sharding, hot rows
  metrics       NE, AUC, GAUC, accuracy and MLPerf's targets
  memory        memory plans on H100s compiled from abstract params (`recsys.memory`)
"""

from jaxinfer.recsys import batch, config, hstu, metrics, synthetic, tables
from jaxinfer.recsys.batch import JaggedBatch, User, pack
from jaxinfer.recsys.config import HSTUConfig
