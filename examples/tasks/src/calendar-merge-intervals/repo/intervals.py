"""Busy intervals and the free time between them."""


def merge(intervals):
    """Merges overlapping or touching [start, end] intervals; the result is sorted by start."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return merged


def free_slots(busy, day_start, day_end):
    """The [start, end] gaps between the busy intervals within [day_start, day_end]."""
    free = []
    cursor = day_start
    for start, end in merge(busy):
        if start > cursor:
            free.append([cursor, min(start, day_end)])
        cursor = max(cursor, end)
        if cursor >= day_end:
            break
    if cursor < day_end:
        free.append([cursor, day_end])
    return [slot for slot in free if slot[0] < slot[1]]


def total_busy(busy):
    return sum(end - start for start, end in merge(busy))
