//! The class of a plugin's failure: what the agent does next (docs/plugin-protocol.md,
//! "Error classes").

/// Exit code of a failure this node cannot get past (it cannot reach the storage, a device
/// is missing, it is at a limit): `EX_UNAVAILABLE` of sysexits.h.
pub const EXIT_ELSEWHERE: i32 = 69;

/// Exit code of a failure of the volume itself (it is broken, gone at the storage):
/// `EX_DATAERR` of sysexits.h.
pub const EXIT_FINAL: i32 = 65;

/// What a failed call says about where it can succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ErrorClass {
    /// Transient: the same call on this node may succeed later (the default).
    RetryHere,
    /// This node cannot do it: the job is to go to another node.
    Elsewhere,
    /// The volume is broken: no node can do it.
    Final,
}

impl ErrorClass {
    /// The class a plugin names in its error object (`"error_class"`): `retry-here`,
    /// `elsewhere` or `final`. `None` for any other word (the exit code decides then).
    pub fn parse(word: &str) -> Option<ErrorClass> {
        match word {
            "retry-here" => Some(ErrorClass::RetryHere),
            "elsewhere" => Some(ErrorClass::Elsewhere),
            "final" => Some(ErrorClass::Final),
            _ => None,
        }
    }

    /// The word of the protocol.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::RetryHere => "retry-here",
            ErrorClass::Elsewhere => "elsewhere",
            ErrorClass::Final => "final",
        }
    }

    /// The class of a failure with no `error_class`, from its status as the runner
    /// describes it (`exit code N`): [`EXIT_ELSEWHERE`], [`EXIT_FINAL`]; every other code
    /// (75, `EX_TEMPFAIL`, included), a signal, a timeout: [`ErrorClass::RetryHere`].
    pub fn of_status(status: &str) -> ErrorClass {
        match exit_code(status) {
            Some(EXIT_ELSEWHERE) => ErrorClass::Elsewhere,
            Some(EXIT_FINAL) => ErrorClass::Final,
            _ => ErrorClass::RetryHere,
        }
    }
}

impl std::fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The code of a status described as `exit code N`.
fn exit_code(status: &str) -> Option<i32> {
    status.strip_prefix("exit code ")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes of the protocol map to their classes; every other failure is transient.
    #[test]
    fn a_status_is_classed_by_its_exit_code() {
        assert_eq!(ErrorClass::of_status("exit code 69"), ErrorClass::Elsewhere);
        assert_eq!(ErrorClass::of_status("exit code 65"), ErrorClass::Final);
        assert_eq!(ErrorClass::of_status("exit code 75"), ErrorClass::RetryHere);
        assert_eq!(ErrorClass::of_status("exit code 1"), ErrorClass::RetryHere);
        assert_eq!(
            ErrorClass::of_status("killed by signal 9"),
            ErrorClass::RetryHere
        );
        assert_eq!(ErrorClass::parse("elsewhere"), Some(ErrorClass::Elsewhere));
        assert_eq!(ErrorClass::parse("Elsewhere"), None);
    }
}
