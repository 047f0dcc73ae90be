//! One module per subcommand.

pub mod tokenize;
pub mod pull;
pub mod models;
pub mod load;
pub mod synth;
pub mod bench;
pub mod serve;

/// Prints an error and its causes on one line, the way every subcommand reports failure.
pub fn report_error(e: &anyhow::Error) {
    let mut msg = format!("error: {e}");
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    eprintln!("{msg}");
}
