//! pager (not yet written).
