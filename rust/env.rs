//! The core's reading of on/off environment switches (`FLAGOS_SHM_CMA`,
//! `FLAGOS_SHM_PROGRESS_BATCH`), with the words the Python side's flags take
//! (`flagos_shm.backend.config`): `0`, `false`, `no` and `off`, in any case, turn a switch
//! off; unset, empty or anything else leaves it on.

/// The values that turn a switch off (compared trimmed and lower-cased).
pub const OFF: [&str; 4] = ["0", "false", "no", "off"];

/// Whether `value` turns a switch off.
pub fn is_off(value: &str) -> bool {
    let v = value.trim().to_ascii_lowercase();
    OFF.contains(&v.as_str())
}

/// Whether the switch named `name` is on: unset, or set to anything but an off word.
pub fn switch_on(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| !is_off(&v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_words_in_any_case_turn_a_switch_off() {
        for v in ["0", "false", "FALSE", " no ", "Off", "off\n"] {
            assert!(is_off(v), "{v:?}");
        }
        for v in ["", "1", "true", "on", "yes", "maybe", "00"] {
            assert!(!is_off(v), "{v:?}");
        }
    }
}
