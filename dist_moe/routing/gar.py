"""GAR's criterion and settings where the design names them; they live in ``dist_moe.gar.objective``."""
from dist_moe.gar.objective import DIFFERENTIABLE, MODES, UNITS, GARConfig, gar_loss, gar_loss_gram

__all__ = ["DIFFERENTIABLE", "MODES", "UNITS", "GARConfig", "gar_loss", "gar_loss_gram"]
