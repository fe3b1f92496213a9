"""A headless toolbar: named buttons with click handlers."""


def make_handlers(names):
    """One zero-argument handler per name; calling the handler for `name` returns
    'clicked <name>'."""
    handlers = []
    for name in names:
        handlers.append(lambda: f"clicked {name}")
    return handlers


class Toolbar:
    def __init__(self, names):
        names = list(names)
        if len(set(names)) != len(names):
            raise ValueError("duplicate button names")
        self.buttons = dict(zip(names, make_handlers(names)))

    def click(self, name):
        if name not in self.buttons:
            raise KeyError(f"no button {name!r}")
        return self.buttons[name]()
