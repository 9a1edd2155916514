"""On-disk format of a gpusnap repository, version 1 (docs/format.md, byte by byte): one
module per file kind, parse and encode only (common: what they share). Everything is
re-exported here, so callers import from gpusnap.repo.format."""

from gpusnap.repo.format.common import *  # noqa: F401,F403
from gpusnap.repo.format.common import Blob, FormatError, READ_CHUNK, ZERO_CHUNK, blob_id, page_id  # noqa: F401
from gpusnap.repo.format.config import encode_config, make_config, parse_config  # noqa: F401
from gpusnap.repo.format.pack import (BlobHeader, check_blob_fields, encode_blob_header, encode_pack_header,  # noqa: F401
                                      encode_pack_trailer, pack_namer, parse_blob_header, parse_pack,
                                      parse_pack_header)
from gpusnap.repo.format.index import IndexFile, encode_index, parse_index  # noqa: F401
from gpusnap.repo.format.pagelist import MAX_PL_RUN, encode_pl_pages, encode_pl_tail, encode_pl_zero, iter_pagelist  # noqa: F401
from gpusnap.repo.format.manifest import check_manifest, encode_manifest, parse_manifest  # noqa: F401
from gpusnap.repo.format.names import image_name_problem, is_pages_image, valid_image_name  # noqa: F401
