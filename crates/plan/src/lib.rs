//! plan (not yet written).
