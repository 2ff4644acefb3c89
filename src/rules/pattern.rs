//! Descriptor value patterns: `*` matches any run of characters (also none), anywhere, any
//! number of times. Nothing else is special.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    /// The literal pieces between the stars.
    parts: Vec<String>,
}

impl Pattern {
    /// `None` when `text` has no `*` (it is then an exact value).
    pub fn new(text: &str) -> Option<Self> {
        if !text.contains('*') {
            return None;
        }
        Some(Self {
            text: text.to_owned(),
            parts: text.split('*').map(str::to_owned).collect(),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// For star-only globs, matching the first piece as a prefix, the last as a suffix and the
    /// middle ones leftmost-first is exact (no backtracking needed). Linear in the value.
    pub fn matches(&self, value: &str) -> bool {
        let (first, rest) = self
            .parts
            .split_first()
            .expect("split yields one part at least");
        let (last, middle) = rest
            .split_last()
            .expect("a pattern has a star, so two parts");
        let Some(mut tail) = value.strip_prefix(first.as_str()) else {
            return false;
        };
        for part in middle {
            match tail.find(part.as_str()) {
                Some(i) => tail = &tail[i + part.len()..],
                None => return false,
            }
        }
        tail.len() >= last.len() && tail.ends_with(last.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Pattern;

    fn m(p: &str, v: &str) -> bool {
        Pattern::new(p).unwrap().matches(v)
    }

    #[test]
    fn stars_anywhere() {
        assert!(m("*", ""));
        assert!(m("*", "anything"));
        assert!(m("foo*", "foo"));
        assert!(m("foo*", "food"));
        assert!(!m("foo*", "fo"));
        assert!(m("*bar", "crowbar"));
        assert!(!m("*bar", "barn"));
        assert!(m("/v1/*/orders", "/v1/users/orders"));
        assert!(!m("/v1/*/orders", "/v1/users/order"));
        assert!(m("a*b*c", "abc"));
        assert!(m("a*b*c", "aXbYbZc"));
        assert!(!m("a*b*c", "acb"));
        assert!(!m("ab*ba", "aba"));
        assert!(m("ab*ba", "abba"));
        assert!(m("**", "x"));
    }

    #[test]
    fn no_star_is_no_pattern() {
        assert!(Pattern::new("plain").is_none());
    }
}
