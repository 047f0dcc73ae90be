//! server (not yet written).
