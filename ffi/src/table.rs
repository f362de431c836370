//! The macro that turns a list of C prototypes into (1) one `unsafe extern "C" fn` pointer type
//! per function, (2) a table struct of those pointers resolved from loaded libraries, required
//! ones as plain fields and optional ones (newer CANN releases) as `Option`, and (3) a
//! [`Declaration`] list with each prototype as text, which the bindgen comparison test checks
//! against CANN's own headers whenever they are installed.

use libloading::Library;

/// One hand-written prototype, as text (parameter name, type) for comparisons.
#[derive(Debug, Clone, Copy)]
pub struct Declaration {
    pub name: &'static str,
    pub params: &'static [(&'static str, &'static str)],
    pub ret: &'static str,
    pub required: bool,
}

/// Resolves `name` from the first library that exports it.
///
/// # Safety
/// `T` must be the function-pointer type of the symbol's documented C prototype.
pub(crate) unsafe fn resolve<T: Copy>(libs: &[(String, &Library)], name: &str) -> Option<T> {
    let mut cname = name.as_bytes().to_vec();
    cname.push(0);
    for (_, lib) in libs {
        // SAFETY: the caller guarantees `T` matches the symbol's C prototype; the symbol is copied
        // out as a plain function pointer and the library is kept loaded for the process' life.
        if let Ok(sym) = unsafe { lib.get::<T>(&cname) } {
            return Some(*sym);
        }
    }
    None
}

#[macro_export]
#[doc(hidden)]
macro_rules! api_table {
    (
        $(#[$meta:meta])*
        pub struct $table:ident ($libdesc:literal) {
            required {
                $( fn $rname:ident ( $($rarg:ident : $rty:ty),* $(,)? ) -> $rret:ty ; )*
            }
            optional {
                $( fn $oname:ident ( $($oarg:ident : $oty:ty),* $(,)? ) -> $oret:ty ; )*
            }
        }
    ) => {
        /// Function-pointer types, one per declared C function, named as in C.
        #[allow(non_camel_case_types, non_snake_case)]
        pub mod sig {
            #[allow(unused_imports)]
            use super::*;
            $( pub type $rname = unsafe extern "C" fn($($rarg: $rty),*) -> $rret; )*
            $( pub type $oname = unsafe extern "C" fn($($oarg: $oty),*) -> $oret; )*
        }

        $(#[$meta])*
        #[allow(non_snake_case)]
        #[derive(Clone, Copy)]
        pub struct $table {
            $( pub $rname: sig::$rname, )*
            $( pub $oname: Option<sig::$oname>, )*
        }

        impl $table {
            /// Which libraries this table's symbols come from (for messages).
            pub const LIBRARIES: &'static str = $libdesc;

            /// Every declaration of this table, as text.
            pub const DECLARATIONS: &'static [$crate::table::Declaration] = &[
                $( $crate::table::Declaration {
                    name: stringify!($rname),
                    params: &[$((stringify!($rarg), stringify!($rty))),*],
                    ret: stringify!($rret),
                    required: true,
                }, )*
                $( $crate::table::Declaration {
                    name: stringify!($oname),
                    params: &[$((stringify!($oarg), stringify!($oty))),*],
                    ret: stringify!($oret),
                    required: false,
                }, )*
            ];

            /// Resolves every symbol from `libs` (searched in order).
            ///
            /// # Safety
            /// The libraries must be CANN's (or an emulation of them): each symbol is taken to
            /// have the documented prototype declared here.
            pub unsafe fn load(
                libs: &[(String, &libloading::Library)],
            ) -> Result<Self, $crate::loader::LoadError> {
                Ok(Self {
                    $( $rname: {
                        // SAFETY: `sig::$rname` is the documented prototype of this symbol.
                        match unsafe { $crate::table::resolve::<sig::$rname>(libs, stringify!($rname)) } {
                            Some(f) => f,
                            None => return Err($crate::loader::LoadError::MissingSymbol {
                                symbol: stringify!($rname),
                                libraries: libs.iter().map(|(p, _)| p.clone()).collect(),
                            }),
                        }
                    }, )*
                    $( $oname: {
                        // SAFETY: `sig::$oname` is the documented prototype of this symbol.
                        unsafe { $crate::table::resolve::<sig::$oname>(libs, stringify!($oname)) }
                    }, )*
                })
            }
        }
    };
}
