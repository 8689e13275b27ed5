"""Small shared pieces every other package may use (and that import no other package of
DHelix): node ids of ranks, the activation memory meter, the hardware fingerprint, the
library-warning filter."""
