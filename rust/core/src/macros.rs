//! Macros shared by the crate's modules.

/// Declares a closed enum whose values have stable names, from one table:
/// the variants (each with its doc), `ALL` (declaration order, so a value's
/// position is its index) and `as_str`.
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$doc:meta])* $variant:ident = $text:literal, )*
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $( $(#[$doc])* $variant, )*
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The stable name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)*
                }
            }
        }
    };
}
