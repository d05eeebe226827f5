"""The bounds that bodies and envelopes share, checked by msgspec while decoding.

Names are 1 to ``MAX_NAME`` characters, counts ``>= 0``, positive numbers ``>= 1``,
request ids ``>= 0``; a list parameter holds at most ``MAX_ITEMS`` numbers
(:mod:`.ops.steps`). A value outside its bounds is a BAD_REQUEST naming the field.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

MAX_ITEMS = 4096
MAX_NAME = 128
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
Count = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
RequestId = Annotated[int, Meta(ge=0)]
