"""Why a tensor is out of tolerance."""
