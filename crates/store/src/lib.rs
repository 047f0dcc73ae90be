//! store (not yet written).
