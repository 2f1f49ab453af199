"""`mslk.utils.torch.library` (spec U-03)."""


def load_library_buck(target: str) -> None:
    """Loads a Buck target in the reference's internal build; open-source builds have none, so a no-op."""
