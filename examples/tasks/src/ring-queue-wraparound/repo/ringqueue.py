"""A fixed-capacity FIFO queue over a preallocated list."""


class RingQueue:
    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._slots = [None] * capacity
        self._head = 0  # index of the oldest item
        self._size = 0

    @property
    def capacity(self):
        return len(self._slots)

    def __len__(self):
        return self._size

    def is_full(self):
        return self._size == self.capacity

    def push(self, item):
        """Appends `item`; OverflowError when the queue is full."""
        if self.is_full():
            raise OverflowError("queue is full")
        tail = self._head + self._size
        self._slots[tail] = item
        self._size += 1

    def pop(self):
        """Removes and returns the oldest item; IndexError when the queue is empty."""
        if self._size == 0:
            raise IndexError("pop from an empty queue")
        item = self._slots[self._head]
        self._slots[self._head] = None
        self._head = (self._head + 1) % self.capacity
        self._size -= 1
        return item

    def peek(self):
        if self._size == 0:
            raise IndexError("peek into an empty queue")
        return self._slots[self._head]

    def __iter__(self):
        """The items from oldest to newest."""
        for offset in range(self._size):
            yield self._slots[(self._head + offset) % self.capacity]
