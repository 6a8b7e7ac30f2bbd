# Warnings and sanitizers shared by every tierflow target.
add_library(tierflow_build_flags INTERFACE)
target_compile_options(tierflow_build_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wno-missing-field-initializers>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:Clang>>:-Wthread-safety>)

if(TIERFLOW_SANITIZE)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX,C>:-fsanitize=${TIERFLOW_SANITIZE}>
                      $<$<COMPILE_LANGUAGE:CXX,C>:-fno-omit-frame-pointer>
                      $<$<COMPILE_LANGUAGE:CXX,C>:-fno-sanitize-recover=all>)
  add_link_options(-fsanitize=${TIERFLOW_SANITIZE})
endif()

# tierflow_module(NAME SOURCES... DEPENDS ...) — one module library with its public
# include/ folder, the shared flags and its install rules.
function(tierflow_module name)
  cmake_parse_arguments(arg "" "" "SOURCES;PUBLIC;PRIVATE" ${ARGN})
  add_library(${name} STATIC ${arg_SOURCES})
  add_library(tierflow::${name} ALIAS ${name})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${name} PUBLIC ${arg_PUBLIC} PRIVATE ${arg_PRIVATE}
                        $<BUILD_INTERFACE:tierflow_build_flags>)
  set_property(GLOBAL APPEND PROPERTY TIERFLOW_MODULES ${name})
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/include)
    install(DIRECTORY include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  endif()
endfunction()
