"""A log's segment index, as rules without I/O (the `SegmentIndex` etcd keeps
at `s/{sid}/sg/{log}`; protos/baton/anchor/v1/segments.proto).

The index stays small whatever the log's length: at most `MAX_RECENT` refs,
the older ones moved into a directory object when the next seal would pass
that bound (`rolled`). Segments are dropped from the bottom only
(`dropping`: below the stream's horizon, or history below the context):
`dropped_below` says which, so the refs a directory still lists below it
count as gone without rewriting the directory.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from baton_runtime._proto.baton.anchor.v1 import segments_pb2 as pb
from baton_runtime.anchor.segments.format import Corrupt

MAX_RECENT = 16


def parse_index(raw: bytes | None) -> pb.SegmentIndex:
    """The stored index (absent: the empty one)."""
    index = pb.SegmentIndex()
    if raw:
        try:
            index.ParseFromString(raw)
        except DecodeError as exc:
            raise Corrupt("the segment index cannot be parsed") from exc
    return index


def live(refs: Sequence[pb.SegmentRef], dropped_below: int) -> list[pb.SegmentRef]:
    return [ref for ref in refs if ref.end > dropped_below]


def covering(refs: Sequence[pb.SegmentRef], seq: int) -> pb.SegmentRef | None:
    """The ref of ascending `refs` whose range holds `seq`."""
    at = bisect.bisect_right([ref.first for ref in refs], seq) - 1
    if at >= 0 and refs[at].first <= seq < refs[at].end:
        return refs[at]
    return None


def needs_directory(index: pb.SegmentIndex, start: int) -> bool:
    """Whether a ref at or after `start` may be listed only in the directory."""
    if not index.HasField("directory"):
        return False
    first_recent = index.recent[0].first if index.recent else index.sealed_below
    return start < first_recent and index.directory.end > max(start, index.dropped_below)


def rolls_over(index: pb.SegmentIndex) -> bool:
    """The next seal moves the recent refs into a new directory."""
    return len(index.recent) >= MAX_RECENT


def rolled(index: pb.SegmentIndex, directory_refs: Sequence[pb.SegmentRef]) -> list[pb.SegmentRef]:
    """What the new directory lists: the old one's live refs, then the recent ones."""
    return live(directory_refs, index.dropped_below) + live(index.recent, index.dropped_below)


def sealed(
    index: pb.SegmentIndex, ref: pb.SegmentRef, *, roll: bool, directory: pb.SegmentRef | None
) -> pb.SegmentIndex:
    """The index after sealing `ref`; with `roll`, the recent refs moved
    into `directory` (None: every one of them was dropped)."""
    after = pb.SegmentIndex()
    after.CopyFrom(index)
    if roll:
        del after.recent[:]
        after.ClearField("directory")
        if directory is not None:
            after.directory.CopyFrom(directory)
    after.recent.append(ref)
    after.sealed_below = ref.end
    return after


@dataclass(frozen=True)
class Dropping:
    """The index after dropping segments below a point, and the objects to
    delete once it is recorded."""

    index: pb.SegmentIndex
    segments: list[pb.SegmentRef]
    directory: pb.SegmentRef | None


def dropping(
    index: pb.SegmentIndex, below: int, directory_refs: Sequence[pb.SegmentRef]
) -> Dropping:
    """Drop every segment ending at or below `below` (`directory_refs`: the
    directory's refs, when it has any that might end there). Nothing below
    `below` needs sealing any more, so `sealed_below` moves up to it."""
    after = pb.SegmentIndex()
    after.CopyFrom(index)
    if below <= index.dropped_below:
        return Dropping(after, [], None)
    gone = [r for r in directory_refs if index.dropped_below < r.end <= below]
    gone += [ref for ref in index.recent if ref.end <= below]
    del after.recent[:]
    after.recent.extend(ref for ref in index.recent if ref.end > below)
    after.dropped_below = below
    after.sealed_below = max(index.sealed_below, below)
    directory = None
    if index.HasField("directory") and index.directory.end <= below:
        directory = pb.SegmentRef()
        directory.CopyFrom(index.directory)
        after.ClearField("directory")
    return Dropping(after, gone, directory)


def dates(index: pb.SegmentIndex, directory_refs: Sequence[pb.SegmentRef]) -> list[tuple[int, int]]:
    """(seq, unix ms) pairs, ascending: every record below seq was committed
    no later than ms; from the live segments (the directory's as a whole
    when its refs are not given)."""
    found: list[tuple[int, int]] = []
    if index.HasField("directory"):
        refs = live(directory_refs, index.dropped_below)
        if refs:
            found += [(ref.end, ref.dated_ms) for ref in refs]
        else:
            found.append((index.directory.end, index.directory.dated_ms))
    found += [(ref.end, ref.dated_ms) for ref in live(index.recent, index.dropped_below)]
    return found
