"""Name -> function tables, so configs can pick an estimator or loss by string (as verl's core_algos)."""


class Registry:
    """A named table of functions; an unknown name fails with the list of known ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries = {}

    def register(self, *names: str):
        """Decorator registering the function under each of `names` (aliases share one entry)."""

        def decorator(fn):
            for name in names:
                if name in self._entries:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

